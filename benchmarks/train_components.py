"""W3's train step taken apart: forward + backward of one decoder block and its parts at the step's
shapes (64 rows x 95 tokens, the tiny model of benchmarks/train_vs_tunix.py, fp32, one device),
each against its matmul FLOPs, interleaved in rounds (best kept):

  attention projections  q, k, v, o as the layer runs them
  attention core         blockwise_attention (one tile: keeps its probabilities for the backward)
  dense core             plain masked softmax attention under autodiff, the reference for the core
  MLP, block             the model's own modules (models.decoder)
  MLP matmuls alone      its three products at the same shapes, nothing else: the matmul rate

  taskset -c 1 python benchmarks/train_components.py [--rounds 8]  ->  benchmarks/out/train_components.json
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_hex.models import decoder  # noqa: E402
from jaxrl_hex.models.attention import Segments, blockwise_attention  # noqa: E402
from jaxrl_hex.models.config import model_config  # noqa: E402

TINY = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=1024,
            tie_embeddings=True, rope_theta=10000.0)  # train_vs_tunix.TINY
ROWS, LENGTH = 64, 95  # W3's rows and the tokens the model runs (96 - 1)


def backward_of(fn, *args):
  """A jitted forward + backward of fn at args, its output's cotangent random."""
  rng = np.random.default_rng(1)
  ct = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), jax.eval_shape(fn, *args))
  return jax.jit(lambda *a: jax.vjp(fn, *a)[1](ct)), args


def cases():
  """{name: (jitted forward + backward, its args, its matmul FLOPs)}."""
  cfg = model_config(**TINY)
  b, t, d, h, kv, hd, f = ROWS, LENGTH, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
  rng = np.random.default_rng(0)
  a = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  mask = Segments.causal(jnp.ones((b, t), jnp.int32), positions)
  table = decoder.rope_table(positions, hd, cfg.rope_theta)
  block = decoder.Block(cfg, nnx.Rngs(0))
  graphdef, state = nnx.split(block)
  part = lambda run: lambda state, x: run(nnx.merge(graphdef, state), x)
  core_flops = 12 * h * hd * b * t * (t + 1) // 2  # causal pairs, forward + backward (train_vs_tunix)
  proj_flops = 6 * b * t * d * (2 * h * hd + 2 * kv * hd)
  mlp_flops = 6 * b * t * d * f * 3

  def dense(q, k, v):
    s = jnp.einsum("bhgqd,bhdk->bhgqk", q, k) * hd**-0.5
    p = jax.nn.softmax(jnp.where(mask.dense()[:, None, None], s, -1e30), axis=-1)
    return jnp.einsum("bhgqk,bhkd->bhgqd", p, v)

  qkv = (a(b, kv, h // kv, t, hd), a(b, kv, hd, t), a(b, kv, t, hd))
  x, x2 = a(b, t, d), a(b * t, d)
  projections = lambda x2, wq, wk, wv, wo: (x2 @ wq, x2 @ wk, x2 @ wv, (x2 @ wq) @ wo)
  return {
      "attention projections":
          (*backward_of(projections, x2, a(d, h * hd), a(d, kv * hd), a(d, kv * hd), a(h * hd, d)), proj_flops),
      "attention core": (*backward_of(lambda q, k, v: blockwise_attention(q, k, v, mask, hd**-0.5), *qkv), core_flops),
      "dense core": (*backward_of(dense, *qkv), core_flops),
      "attention layer":
          (*backward_of(part(lambda m, x: m.attn(x, table, mask, None, 0)[0]), state, x), proj_flops + core_flops),
      "MLP": (*backward_of(part(lambda m, x: m.mlp(x)), state, x), mlp_flops),
      "MLP matmuls alone":
          (*backward_of(lambda x2, h, wg, wu, wd:
                        (x2 @ wg, x2 @ wu, h @ wd), x2, a(b * t, f), a(d, f), a(d, f), a(f, d)), mlp_flops),
      "block": (*backward_of(part(lambda m, x: m(x, table, mask, None, 0)[0]), state, x),
                proj_flops + core_flops + mlp_flops),
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--rounds", type=int, default=8)
  args = ap.parse_args()
  parts = cases()
  best = {name: float("inf") for name in parts}
  for _ in range(args.rounds):
    for name, (fn, fn_args, _) in parts.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*fn_args))
      best[name] = min(best[name], time.perf_counter() - t0)
  out = {name: dict(ms=best[name] * 1e3, gflops_per_s=flops / best[name] / 1e9) for name, (*_, flops) in parts.items()}
  for name, r in out.items():
    print(f"{name:22s} {r['ms']:7.1f} ms  {r['gflops_per_s']:6.1f} GFLOP/s")
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  with open(os.path.join(HERE, "out", "train_components.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  from jaxrl_hex.host_memory import restart_with_tunables
  restart_with_tunables()  # with glibc's tunables, as the jaxrl-hex program starts (jaxrl_hex/host_memory.py)
  main()
