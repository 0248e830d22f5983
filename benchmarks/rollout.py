"""Rollout throughput: one workload on one engine -> one JSON object (new tokens per second).

  python benchmarks/rollout.py --workload W1 --engine ours --json
  python benchmarks/rollout.py --workload W5 --engine tunix --json   # runs in benchmarks/.venv-tunix

Engines: ours (continuous batching, jaxrl_hex.rollout.engine), naive (our static-batch decode,
benchmarks/rollout_naive.py), tunix (Tunix's vanilla Sampler with a Qwen3 model of the same
shape, in its own virtual environment: bash benchmarks/setup_tunix.sh).

Model: a tiny Qwen3-like decoder (vocab 512, d_model 256, 4 layers, 4 query / 2 KV heads,
head_dim 64, MLP 1024, fp32, random weights). Ours has no QK-norm (jaxrl_hex's decoder lacks
it); Tunix's Qwen3 has it, which costs it two small RMSNorms per layer. EOS is unreachable
(id = vocab size), so lengths are set by each request's token budget. Every engine gets the
same slot budget (rows decoded at once); new tokens counted are the requested ones.

Timing: one cold run (compile + run), then --repeats warm runs; new_tokens_per_s uses the
best warm run (the machine is shared: the fastest run is the least disturbed one) and
compile_s = cold - best warm.

The limit (engine ours): a plain jitted loop of the decode step's weight matmuls alone -- per
layer the q, k, v and o projections, gate, up and down, then the output head -- on the engine's
weights, at its slot batch and dtype, for as many steps as the engine's decode ran; no
attention, no sampling, no prefill. It runs in the same process, interleaved with the engine's
warm runs (ours, limit, ours, limit, ...), and limit_tokens_per_s = the engine's new tokens /
the limit's best time, so ours_over_limit is the share of the matmul rate the engine reaches.
The engine also prefills its prompts, which that limit leaves out: a second chain, the prefill's
weight matmuls over the prompt tokens a run caches (matmul_limit's `cached`), runs after each
limit run, and ours_over_run_limit = (both limits' best times) / the engine's best time is the
share of the matmul rate for all the matmul work a run does (prefill_over_limit: the prefill
alone, waited on, against its chain).
--layout 2x2 runs both on 4 simulated CPU devices laid out as meshes/cpu-8.yaml's rollout pool
(data 2 x tensor 2, the default rules): the limit's weights have the engine's shardings and its
activations the model's (rows over data, heads and the MLP over tensor), so it pays the same
tensor-parallel all-reduces.

This file must not import jaxrl_hex at module level: the tunix engine runs it in the Tunix venv.
"""
import argparse
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TUNIX_PYTHON = os.path.join(HERE, ".venv-tunix", "bin", "python")
MODEL = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=1024)
PAD, BOS = 0, 1
EOS = MODEL["vocab_size"]  # never sampled
ENGINES = ("ours", "naive", "tunix")
LAYOUTS = {"1": {}, "2x2": {"data": 2, "tensor": 2}}  # mesh axes of the rollout pool


def device_count(layout: str) -> int:
  return int(np.prod(list(LAYOUTS[layout].values()) or [1]))


def workload(name: str) -> dict:
  """prompts [n, P] token ids (BOS first), group (samples per prompt), budgets [n * group] (prompt-major), slots."""
  rng = np.random.default_rng(0)
  if name == "W1":  # decode: 32 prompts x 32 tokens, 64 new tokens each
    n, group, budgets, slots = 32, 1, [64] * 32, 32
  elif name == "W2":  # group decode: 8 prompts x 8 samples
    n, group, budgets, slots = 8, 8, [64] * 64, 64
  elif name == "W5":  # long tail: 90% stop at 16 new tokens, 10% at 256; 32 slots for everyone
    n, group, slots = 256, 1, 32
    budgets = rng.permutation([256] * 26 + [16] * 230).tolist()
  else:
    raise SystemExit(f"--workload {name!r}: use W1, W2 or W5")
  prompts = np.concatenate([np.full((n, 1), BOS), rng.integers(3, MODEL["vocab_size"], (n, 31))], 1)
  return dict(prompts=prompts.astype(np.int32), group=group, budgets=budgets, slots=slots, max_new=max(budgets))


def timed(run, repeats: int) -> tuple[float, float, int]:
  """-> (best warm seconds, compile seconds, new tokens of one run)."""
  t0 = time.perf_counter()
  tokens = run(0)
  cold = time.perf_counter() - t0
  warm = []
  for i in range(repeats):
    t0 = time.perf_counter()
    got = run(i + 1)
    warm.append(time.perf_counter() - t0)
    assert got == tokens, (got, tokens)
  best = min(warm)
  return best, max(cold - best, 0.0), tokens


class IntTokenizer:
  """Token ids written as space-separated integers (both engines take ids; text only for output)."""
  pad_id, bos_id, eos_id = PAD, BOS, EOS

  def encode(self, text):
    return [int(t) for t in text.split()]

  def decode(self, ids):
    return " ".join(str(int(i)) for i in ids)


def _our_policy(layout="1", scan_layers=False):
  import jax

  from jaxrl_hex import meshes
  from jaxrl_hex.models.config import model_config
  from jaxrl_hex.models.policy import Policy
  axes, n = LAYOUTS[layout], device_count(layout)
  pool = meshes.Pool(meshes.PoolSpec("rollout", tuple(range(n)), axes, dict(meshes.DEFAULT_RULES)), jax.devices()[:n])
  policy = Policy.build(model_config(**MODEL, scan_layers=scan_layers))
  return pool, policy, policy.init(0, pool.shardings_for(policy.logical_axes(), policy.shapes()))


def matmul_limit(policy, pool, params, batch: int, steps: int, cached=None, attend=0):
  """The decode step's weight matmuls alone, `steps` times over `batch` rows -> run() (blocks
  until done). Activations keep the model's logical axes, so on a mesh the chain is partitioned
  as the engine's step is. Only what joins the matmuls is added: k and v added to their query
  heads (for the o projection), gate x up, one RMS rescale per step (keeps values finite) and a
  running sum of the logits (keeps the head alive). Stacked params (model.scan_layers) are
  unstacked first: the limit is the same chain of matmuls either way.

  cached: instead, the prefill's weight matmuls once over `cached` prompt tokens: every layer's
  k and v, and all but the last layer's q, o and MLP (the prefill keeps the cache alone; the
  first new token comes from the first decode step, which the decode chain counts).

  attend > 0: the decode chain with attention's two matmuls too, per layer q . K and s . V over a
  cache of `attend` columns (each layer its own, laid out and sharded as the engine's cache), so
  the chain also reads as much KV cache as a decode that attends to that many columns a row."""
  import jax
  import jax.numpy as jnp

  from jaxrl_hex.models.decoder import unstack_layers
  cfg = policy.cfg
  if cfg.scan_layers:
    params = unstack_layers(params, cfg.n_layers)
  dt = jnp.dtype(cfg.dtype)
  act = lambda x, *axes: jax.lax.with_sharding_constraint(x, pool.sharding(axes, x.shape))
  kv, group, hd = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim

  proj = lambda x, w: x @ w.reshape(x.shape[-1], -1).astype(dt)
  head = lambda params, x: act(proj(x, params["lm_head"]), "batch", "vocab_out")

  def layers(params, x, caches=None):  # x [rows, d_model] -> (x, the last layer's k + v)
    blocks = list(params["layers"].values())
    for i, layer in enumerate(blocks):
      a, m = layer["attn"], layer["mlp"]
      k = act(proj(x, a["wk"]).reshape(-1, kv, 1, hd), "batch", "kv_heads", None, None)
      v = act(proj(x, a["wv"]).reshape(-1, kv, 1, hd), "batch", "kv_heads", None, None)
      if cached is not None and i == len(blocks) - 1:
        return x, k + v
      q = act(proj(x, a["wq"]).reshape(-1, kv, group, hd), "batch", "kv_heads", None, None)
      if caches is not None:  # [B, KV, G, hd] @ [B, KV, hd, C] -> [B, KV, G, C] @ [B, KV, C, hd]
        scores = jnp.matmul(q, caches[i][0]) * (hd * attend)**-0.5  # (the scale keeps values finite)
        q = act(jnp.matmul(scores, caches[i][1]), "batch", "kv_heads", None, None)
      x = act(x + proj((q + k + v).reshape(x.shape[0], -1), a["wo"]), "batch", None)
      h = act(proj(x, m["gate"]), "batch", "mlp") * act(proj(x, m["up"]), "batch", "mlp")
      x = act(x + proj(h, m["down"]), "batch", None)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6), None

  if cached is None:
    rows = batch

    def chain(params, x, caches):  # x [batch, d_model]
      acc = jnp.zeros((batch, cfg.vocab_size), dt)

      def step(_, carry):
        x, acc = carry
        x = layers(params, x, caches)[0]
        return x, acc + head(params, x)

      return jax.lax.fori_loop(0, steps, step, (x, acc))[1]
  else:
    rows = cached

    def chain(params, x, caches):  # x [cached, d_model]
      return layers(params, x)[1]

  rng = np.random.default_rng(0)
  x = jax.device_put(rng.standard_normal((rows, cfg.d_model)).astype(dt), pool.sharding(("batch", None)))
  caches = None
  if attend:
    from jaxrl_hex.models.decoder import CACHE_AXES
    size = dict(batch=batch, kv_heads=kv, head_dim=hd, length=attend)
    new = lambda axes: jax.device_put(rng.standard_normal([size[a] for a in axes]).astype(dt), pool.sharding(axes))
    caches = [tuple(new(axes) for axes in CACHE_AXES) for _ in range(cfg.n_layers)]
  compiled = jax.jit(chain).lower(params, x, caches).compile()
  return lambda: compiled(params, x, caches).block_until_ready()


def our_engine(w, pool, policy, params, steps_per_sync=16, kv_page_size=0):
  """jaxrl_hex's engine for workload w, with params loaded as version 0."""
  from jaxrl_hex.rollout.engine import Engine
  engine = Engine(policy, pool, IntTokenizer(), w["max_new"], temperature=1.0, slots=w["slots"],
                  max_prompt_len=w["prompts"].shape[1], eos_ids=(EOS,), steps_per_sync=steps_per_sync,
                  kv_page_size=kv_page_size)
  engine.load_weights(0, params)
  return engine


def run_workload(engine, w, seed) -> int:
  """Workload w through our engine once, sampling with `seed` -> its new tokens."""
  import jax

  from jaxrl_hex.rollout.engine import Request
  g = w["group"]
  engine.rng = jax.random.key(seed)
  engine.submit([Request(p.tolist(), n=g, max_tokens=w["budgets"][i * g]) for i, p in enumerate(w["prompts"])])
  samples = []
  while engine.pending:
    samples += engine.poll()
  return sum(len(s.tokens) for s in samples)


def run_ours(w, repeats, steps_per_sync, kv_page_size=0, layout="1", scan_layers=False, paged_gather=False):
  import jax

  pool, policy, params = _our_policy(layout, scan_layers)
  engine = our_engine(w, pool, policy, params, steps_per_sync, kv_page_size)
  if paged_gather:  # decode on the blocks, as a pool without room for a call's copy does
    engine.paged_copy = False
  run = functools.partial(run_workload, engine, w)

  t0 = time.perf_counter()
  tokens, steps = run(0), engine.decode_steps
  cold = time.perf_counter() - t0
  # the prompt tokens a run caches (each row's last is its first decode step's input), rounded up
  # to whole rows per device
  cached = -(-(engine.prefill_tokens - len(w["prompts"])) // len(pool.devices)) * len(pool.devices)
  # the cache columns the run's new tokens attend to (token j of a row: the P cached and pending
  # prompt tokens and the j before it), spread over its decode steps' rows
  p_len = w["prompts"].shape[1]
  attend = max(1, round(sum(p_len + j for b in w["budgets"] for j in range(b)) / (steps * w["slots"])))
  limit_of = functools.partial(matmul_limit, policy, pool, params, w["slots"], steps)
  chains = dict(limit=limit_of(), prefill=limit_of(cached=cached), attention=limit_of(attend=attend))
  for chain in chains.values():
    chain()  # warm
  best, best_chain = float("inf"), dict.fromkeys(chains, float("inf"))
  for i in range(repeats):  # interleaved: ours, each chain, ours, ...
    t0 = time.perf_counter()
    got = run(i + 1)
    best = min(best, time.perf_counter() - t0)
    assert got == tokens, (got, tokens)
    for name, chain in chains.items():
      t0 = time.perf_counter()
      chain()
      best_chain[name] = min(best_chain[name], time.perf_counter() - t0)
  best_limit, best_prefill_limit = best_chain["limit"], best_chain["prefill"]
  full_limit = best_chain["attention"] + best_prefill_limit
  # one more run with each prefill waited on: otherwise its program runs on while the host goes
  # on, and the next decode call's wait for its outputs holds it
  prefill_s, plain = [0.0], engine._prefill

  def waited(entries):
    t0 = time.perf_counter()
    plain(entries)
    jax.block_until_ready(engine._state)
    prefill_s[0] += time.perf_counter() - t0

  engine._prefill = waited
  t0 = time.perf_counter()
  run(repeats + 1)
  split = time.perf_counter() - t0
  decode_s = split - prefill_s[0]
  return dict(seconds=best, compile_s=max(cold - best, 0.0), new_tokens=tokens, compile_count=engine.compile_count,
              kv_cache_bytes=engine.memory["kv_cache_bytes"], decode_steps=steps, limit_seconds=best_limit,
              limit_tokens_per_s=tokens / best_limit, ours_over_limit=best_limit / best, layout=layout,
              scan_layers=scan_layers, prefill_share=prefill_s[0] / split, decode_over_limit=best_limit / decode_s,
              cached_prompt_tokens=cached, prefill_limit_seconds=best_prefill_limit,
              run_limit_tokens_per_s=tokens / (best_limit + best_prefill_limit),
              ours_over_run_limit=(best_limit + best_prefill_limit) / best,
              prefill_over_limit=best_prefill_limit / prefill_s[0], attend_columns=attend,
              attention_limit_seconds=best_chain["attention"], full_limit_tokens_per_s=tokens / full_limit,
              ours_over_full_limit=full_limit / best)


def run_naive(w, repeats):
  import jax

  sys.path.insert(0, HERE)
  from rollout_naive import make_static_generate
  pool, policy, params = _our_policy()
  rows = np.repeat(w["prompts"], w["group"], 0)
  budgets = np.asarray(w["budgets"], np.int32)
  valid = np.ones_like(rows, bool)
  generate = make_static_generate(policy, w["max_new"], EOS, dict(temperature=1.0))
  b = w["slots"]

  def run(seed):
    total = 0
    for i in range(0, len(rows), b):  # static batches of the slot budget
      _, mask, _ = generate(params, rows[i:i + b], valid[i:i + b], budgets[i:i + b], jax.random.key(seed * 1000 + i))
      total += int(jax.device_get(mask).sum())
    return total

  seconds, compile_s, tokens = timed(run, repeats)
  return dict(seconds=seconds, compile_s=compile_s, new_tokens=tokens)


def run_tunix(w, repeats):
  """Tunix's vanilla Sampler on a Qwen3 of the same shape; batches of the slot budget, each to its
  longest budget (the Sampler has no per-request token budget)."""
  from flax import nnx
  from tunix.generate import sampler as tunix_sampler
  from tunix.models.qwen3 import model as qwen3

  class Tok(IntTokenizer):  # Tunix's adapter calls these as methods

    def bos_id(self):
      return BOS

    def eos_id(self):
      return EOS

    def pad_id(self):
      return PAD

  cfg = qwen3.ModelConfig(num_layers=MODEL["n_layers"], vocab_size=MODEL["vocab_size"], embed_dim=MODEL["d_model"],
                          hidden_dim=MODEL["mlp_dim"], num_heads=MODEL["n_heads"], head_dim=MODEL["head_dim"],
                          num_kv_heads=MODEL["n_kv_heads"], rope_theta=10000, norm_eps=1e-6)
  model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
  p_len = w["prompts"].shape[1]
  cache = tunix_sampler.CacheConfig(cache_size=p_len + w["max_new"], num_layers=cfg.num_layers,
                                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
  sampler = tunix_sampler.Sampler(model, Tok(), cache)
  rows = [" ".join(map(str, p[1:])) for p in np.repeat(w["prompts"], w["group"], 0)]  # Tunix adds the BOS
  budgets, b = w["budgets"], w["slots"]

  def run(seed):
    total = 0
    for i in range(0, len(rows), b):
      out = sampler(rows[i:i + b], max_generation_steps=w["max_new"], max_prompt_length=p_len, temperature=1.0,
                    top_p=1.0, top_k=None, seed=seed * 1000 + i, eos_tokens=[EOS], return_logprobs=True)
      total += sum(min(len(t), n) for t, n in zip(out.tokens, budgets[i:i + b]))
    return total

  seconds, compile_s, tokens = timed(run, repeats)
  return dict(seconds=seconds, compile_s=compile_s, new_tokens=tokens)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workload", required=True, choices=("W1", "W2", "W5"))
  ap.add_argument("--engine", required=True, choices=ENGINES)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--steps-per-sync", type=int, default=16)
  ap.add_argument("--kv-page-size", type=int, default=0, help="ours: page the KV cache (rollout.kv_page_size)")
  ap.add_argument("--layout", default="1", choices=tuple(LAYOUTS),
                  help="ours: the rollout pool, one device or data 2 x tensor 2 on 4 simulated CPU devices")
  ap.add_argument("--paged-gather", action="store_true",
                  help="ours, with --kv-page-size: decode on the blocks (paged_decode: gather), not on a call's copy")
  ap.add_argument("--scan-layers", action="store_true",
                  help="ours: the model's layers stacked and run by one scan (model.scan_layers)")
  ap.add_argument("--json", action="store_true", help="print one JSON object (the default prints a line)")
  args = ap.parse_args(argv)
  in_tunix_venv = os.path.realpath(sys.prefix) == os.path.realpath(os.path.dirname(os.path.dirname(TUNIX_PYTHON)))
  if not in_tunix_venv:  # (that venv has no jaxrl_hex; it inherits the tunable from this process)
    from jaxrl_hex.host_memory import restart_with_tunables
    restart_with_tunables()  # with glibc's tunables, as the jaxrl-hex program starts (jaxrl_hex/host_memory.py)
  if args.engine == "tunix" and not in_tunix_venv:
    if not os.path.exists(TUNIX_PYTHON):
      raise SystemExit(f"{TUNIX_PYTHON} is missing; run: bash benchmarks/setup_tunix.sh")
    return subprocess.call([TUNIX_PYTHON, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])])
  if (args.layout != "1" or args.scan_layers or args.paged_gather) and args.engine != "ours":
    raise SystemExit("--layout, --scan-layers and --paged-gather run --engine ours only")
  if args.paged_gather and not args.kv_page_size:
    raise SystemExit("--paged-gather needs --kv-page-size")
  import jax
  if args.layout != "1":
    from jaxrl_hex.meshes import prepare_cpu_devices
    prepare_cpu_devices(device_count(args.layout))
  w = workload(args.workload)
  if args.engine == "ours":
    out = run_ours(w, args.repeats, args.steps_per_sync, args.kv_page_size, args.layout, args.scan_layers,
                   args.paged_gather)
  elif args.engine == "naive":
    out = run_naive(w, args.repeats)
  else:
    out = run_tunix(w, args.repeats)
  result = dict(workload=args.workload, engine=args.engine, new_tokens_per_s=out["new_tokens"] / out["seconds"], **out,
                slots=w["slots"], jax=jax.__version__, device=str(jax.devices()[0].platform))
  print(
      json.dumps(result) if args.json else f"{args.workload} {args.engine}: {result['new_tokens_per_s']:.0f} "
      f"new tokens/s, compile {result['compile_s']:.1f}s" +
      (f", {result['ours_over_limit']:.2f} of the matmul limit (prefill {result['prefill_share']:.0%} of a run, "
       f"the rest {result['decode_over_limit']:.2f} of the limit); {result['ours_over_run_limit']:.2f} of the limit "
       f"with the prefill's matmuls (prefill alone {result['prefill_over_limit']:.2f} of its own); "
       f"{result['ours_over_full_limit']:.2f} with attention's matmuls too ({result['attend_columns']} columns)"
       if "ours_over_limit" in result else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
