"""Compiled temp memory of the trainer's token logprobs at a real vocabulary: the whole-vocab
head (fp32 logits [R, L, V], log_softmax and its exp at once) against rl.layout's chunked head.

Nothing runs: the gradient of the mean logprob w.r.t. the params is lowered from abstract shapes
(no weights) and compiled on the CPU backend, and XLA's memory_analysis() gives each program's
temp bytes. Qwen2-1.5B's shapes (vocab 151,936, d_model 1536, tied head) on 2 of its 28 layers,
8 rows of 1024 and of 4096 tokens, fp32 compute (the model config's default; with bf16, XLA:CPU
upcasts the head's dots to fp32 and its fp32 copies of the head blur the comparison). `head` is the
output head alone (hidden states in, their gradient out); `model` is layout_logprobs through the
layers: the whole-vocab program also runs attention densely (a [R, L, L] mask and [R, H, L, L]
scores), as the trainer did before models.attention; the chunked one runs it blockwise.

  python benchmarks/logprob_memory.py [--lengths 1024 4096] [--chunks 128 256 512]
    ->  benchmarks/out/logprob_memory.json
"""
import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_hex.models.attention import Segments  # noqa: E402
from jaxrl_hex.models.config import model_config  # noqa: E402
from jaxrl_hex.models.policy import Policy  # noqa: E402
from jaxrl_hex.rl.layout import Rows, chunked_logprobs, layout_logprobs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN2_1_5B = dict(vocab_size=151936, d_model=1536, n_heads=12, n_kv_heads=2, head_dim=128, mlp_dim=8960,
                  tie_embeddings=True, qkv_bias=True, dtype="float32", param_dtype="float32")
GIB = 2**30


def whole_vocab_logprobs(logits, targets):
  """What rl.layout computed before chunking: every [R, L, V] fp32 array of the micro-batch at once."""
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
  return logp, -(jnp.exp(logp_all) * logp_all).sum(-1)


def whole_vocab_layout_logprobs(policy, params, rows):
  """Before chunking and blockwise attention: a dense [R, L, L] mask and [R, H, L, L] scores too."""
  mask = Segments.causal(rows.segments[:, :-1], rows.positions[:, :-1]).dense()
  logits, _ = policy.apply(params, rows.tokens[:, :-1], rows.positions[:, :-1], mask)
  return whole_vocab_logprobs(jnp.pad(logits, ((0, 0), (1, 0), (0, 0))), rows.tokens)


def programs(policy, chunk):
  """scope -> (fn, argnums) of the gradient of the mean logprob; chunk None = the whole-vocab head."""
  if chunk is None:
    head = lambda p, h, y: whole_vocab_logprobs(policy.logits(p, h), y)[0].mean()
    model = lambda p, rows: whole_vocab_layout_logprobs(policy, p, rows)[0].mean()
  else:
    head = lambda p, h, y: chunked_logprobs(policy, p, h, y, chunk=chunk)[0].mean()
    model = lambda p, rows: layout_logprobs(policy, p, rows, chunk=chunk)[0].mean()
  return {"head": (head, (0, 1)), "model": (model, 0)}


def measure(fn, argnums, *args):
  start = time.perf_counter()
  compiled = jax.jit(jax.grad(fn, argnums=argnums)).lower(*args).compile()
  seconds = time.perf_counter() - start
  mem = compiled.memory_analysis()
  return dict(temp_bytes=mem.temp_size_in_bytes, argument_bytes=mem.argument_size_in_bytes,
              output_bytes=mem.output_size_in_bytes, compile_s=round(seconds, 2))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
  ap.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512])
  ap.add_argument("--layers", type=int, default=2)
  args = ap.parse_args()
  policy = Policy.build(model_config(**QWEN2_1_5B, n_layers=args.layers, max_seq_len=max(args.lengths)))
  params = policy.shapes()
  cfg = policy.cfg
  results = []
  for length in args.lengths:
    ints = jax.ShapeDtypeStruct((args.rows, length), jnp.int32)
    hidden = jax.ShapeDtypeStruct((args.rows, length, cfg.d_model), jnp.dtype(cfg.dtype))
    inputs = {
        "head": (params, hidden, ints),
        "model": (params, Rows(tokens=ints, positions=ints, segments=ints, seq=ints))
    }
    for chunk in [None, *args.chunks]:
      for scope, (fn, argnums) in programs(policy, chunk).items():
        row = dict(scope=scope, rows=args.rows, length=length, chunk=chunk, **measure(fn, argnums, *inputs[scope]))
        results.append(row)
        print(row, flush=True)
  logits_gib = {length: args.rows * length * cfg.vocab_size * 4 / GIB for length in args.lengths}
  print(f"\nvocab {cfg.vocab_size}, d_model {cfg.d_model}, {args.layers} layers, {args.rows} rows; "
        f"default chunk {cfg.logprob_chunk}; one [R, L, V] fp32 array = " +
        ", ".join(f"{v:.2f} GiB at L={k}" for k, v in logits_gib.items()))
  print(f"{'scope':6} {'L':>5} {'chunk':>6} {'temp GiB':>9} {'vs whole':>9} {'compile s':>10}")
  base = {(r["scope"], r["length"]): r["temp_bytes"] for r in results if r["chunk"] is None}
  for r in results:
    ratio = r["temp_bytes"] / base[r["scope"], r["length"]]
    print(f"{r['scope']:6} {r['length']:5} {r['chunk'] or 'whole':>6} {r['temp_bytes'] / GIB:9.2f} {ratio:9.3f} "
          f"{r['compile_s']:10.1f}")
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  with open(os.path.join(HERE, "out", "logprob_memory.json"), "w") as f:
    json.dump(
        dict(model={k: cfg[k] for k in QWEN2_1_5B} | {"n_layers": args.layers}, default_chunk=cfg.logprob_chunk,
             jax=jax.__version__, backend=jax.default_backend(), results=results), f, indent=1)


if __name__ == "__main__":
  main()
