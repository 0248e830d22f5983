"""The GPU check of issue 20, one prepared command of a few minutes on one accelerator:

  decode  a ~1B-parameter bf16 decoder through the engine's decode step: tokens/s and the share of
          the HBM roofline (bytes one step must read: every weight + the KV columns it attends
          over, per second, against the device-to-device copy rate measured here); beside it the
          step's matmuls alone (weights and attention over the same columns, rollout.py's chain)
  train   the real Trainer's GRPO update (AdamW, bf16) on the same model: MFU = model FLOPs per
          step (6 x matmul params x tokens + causal attention) / step time / the chip's peak
          (catalog bf16_tflops), and the share of a large bf16 matmul's rate measured here
  sync    weight sync of the same params: device_put onto a second buffer (DevicePutSync) against
          the copy rate, Orbax save + restore (when orbax is installed) against the disk's
          write + fsync + read rate, and direct sync through shared memory (device to host, host
          to device: GB/s alone)
  rl      one end-to-end GRPO step per real shape (Qwen2.5-0.5B and -1.5B, random weights, bf16
          compute, fp32 master weights), rollout and train pools on the one device as
          meshes/single.yaml lays them: weight sync (device_put onto the rollout pool) seconds, the
          engine's generate of prompts x group completions in tokens/s against the HBM roofline
          (the bytes a decode step must read, weights at the compute dtype + the KV columns
          attended, against the copy rate), and the trainer's update: MFU against the catalog's
          peak and the share of the bf16 matmul rate measured here
  init    (not in all) seconds to compile Policy.init listed at 2, 6 and all layers and stacked

One JSON object on stdout per part and all of them in $OUT/gpu_check.json when OUT is set.

  PYTHONPATH=$PWD python3 benchmarks/gpu_check.py [--part decode|train|sync|rl|init|all] [--smoke]

--smoke runs a tiny model on any device (CPU here) to check the script itself.
"""
import argparse
import collections
import gzip
import json
import os
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

# ~1.0B parameters: 18 layers x 47.2M + 2 x 32000 x 2048 embeddings (untied)
MODEL = dict(vocab_size=32000, d_model=2048, n_layers=18, n_heads=16, n_kv_heads=8, head_dim=128, mlp_dim=5632,
             dtype="bfloat16", param_dtype="bfloat16")
# fp32: XLA:CPU compiles bf16 programs slowly (minutes)
SMOKE = dict(MODEL, n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=512, vocab_size=1024,
             dtype="float32", param_dtype="float32")
# The RL step's shapes (the models' config.json; Qwen2.5-1.5B's are configs/models/qwen2_1_5b.py's):
# bf16 compute on fp32 master weights, as a run's auto dtype picks on an accelerator.
QWEN2_5 = dict(vocab_size=151936, tie_embeddings=True, qkv_bias=True, rope_theta=1000000.0, norm_eps=1e-6,
               dtype="bfloat16", param_dtype="float32", scan_layers=True, remat="full")
RL_MODELS = {
    "qwen2.5-0.5b": dict(QWEN2_5, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, mlp_dim=4864),
    "qwen2.5-1.5b": dict(QWEN2_5, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, mlp_dim=8960),
}
SINGLE = os.path.join(os.path.dirname(HERE), "meshes", "single.yaml")  # both pools on device 0


def copy_rate(nbytes, repeats=20) -> float:
  """Bytes per second a device-to-device copy of an nbytes array moves (each byte read once and
  written once: a weight sync's own bound)."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  copy = jax.jit(lambda a: a + jnp.bfloat16(1))
  copy(x).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(repeats):
    x = copy(x)
  x.block_until_ready()
  return nbytes * repeats / (time.perf_counter() - t0)


def matmul_flops(n, repeats=10) -> float:
  """FLOP/s of an n x n x n bf16 matmul chain: what the chip's matmul units reach here."""
  # random data: constant operands run faster than real ones on some chips
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32) * n**-0.5, jnp.bfloat16)
  chain = jax.jit(lambda x: x @ a)
  x = chain(a).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(repeats):
    x = chain(x)
  x.block_until_ready()
  return 2 * n**3 * repeats / (time.perf_counter() - t0)


def peak_flops(device) -> float | None:
  """bf16 FLOP/s of the device's type in the planner's catalog (None for an unlisted type)."""
  try:
    from jaxrl_hex.planner.catalog import load_catalog
  except ImportError:  # the catalog needs PyYAML, which a bare accelerator image may lack
    return None
  kind = str(device.device_kind).upper()
  matches = [d for name, d in load_catalog().items() if name.upper() in kind]
  return max(matches, key=lambda d: len(d.name)).flops if matches else None


class Tok:  # token ids in, ids out: no text involved
  pad_id, bos_id = 0, 1

  def __init__(self, vocab):
    self.eos_id = vocab  # unreachable: every sequence runs its budget

  def decode(self, ids):
    return ""


def build(model):
  from jaxrl_hex import meshes
  from jaxrl_hex.models.config import model_config
  from jaxrl_hex.models.policy import Policy
  cfg = model_config(**model)
  pool = meshes.Pool(meshes.PoolSpec("pool", (0,), {}, dict(meshes.DEFAULT_RULES)), jax.devices()[:1])
  policy = Policy.build(cfg)
  return cfg, pool, policy, random_params(policy.shapes(), pool.shardings_for(policy.logical_axes(), policy.shapes()))


def random_params(shapes, shardings):
  """Params of these shapes drawn on the host, one draw per distinct shape (layers share theirs):
  the speed figures need no trained or distinct weights, and Policy.init's one program took ~2 min
  to compile for MODEL on an H200 (XLA:GPU, jax 0.11.2; 6 s on XLA:CPU)."""
  rng, drawn = np.random.default_rng(0), {}

  def draw(shape, sharding):
    if shape.shape not in drawn:  # norm scales 1, matrices N(0, 1 / fan_in)
      drawn[shape.shape] = (np.ones(shape.shape, np.float32) if len(shape.shape) == 1 else
                            rng.standard_normal(shape.shape, np.float32) * shape.shape[0]**-0.5)
    return jax.device_put(drawn[shape.shape].astype(shape.dtype), sharding)

  return jax.tree.map(draw, shapes, shardings)


def part_decode(model, args) -> dict:
  from rollout import matmul_limit  # benchmarks/rollout.py

  from jaxrl_hex.models.config import param_count
  from jaxrl_hex.rollout.engine import Engine, Request
  cfg, pool, policy, params = build(model)
  engine = Engine(policy, pool, Tok(model["vocab_size"]), args.new, temperature=1.0, slots=args.slots,
                  max_prompt_len=args.prompt, steps_per_sync=args.chunk)
  engine.load_weights(0, params)
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, model["vocab_size"], args.prompt - 1).tolist() for _ in range(args.slots)]

  def run(seed):
    """-> (seconds, ring columns attended) of each hand-back (the first includes the prefill)."""
    engine.rng = jax.random.key(seed)
    engine.submit([Request(p) for p in prompts])
    chunks = []
    while engine.pending:
      span = engine._span(engine._t + engine.steps_per_sync)  # what this hand-back's decode reads
      t0 = time.perf_counter()
      engine.poll()
      chunks.append((time.perf_counter() - t0, span))
    return chunks

  t0 = time.perf_counter()
  run(0)  # compiles prefill + decode
  compile_s = time.perf_counter() - t0
  chunks = [c for seed in (1, 2) for c in run(seed)[1:]]  # hand-backs of pure decode steps
  step_s = sum(t for t, _ in chunks) / (len(chunks) * args.chunk)
  bandwidth = 2 * copy_rate(args.copy_bytes)  # read + written bytes per second
  kv_bytes = engine.memory["kv_cache_bytes"]
  span = float(np.mean([span for _, span in chunks]))
  weight_bytes = decode_weight_bytes(params, args.slots, cfg.dtype)
  bytes_per_step = int(weight_bytes + kv_bytes * span / engine.length)
  # what the step's matmuls alone take (weights + attention over the same columns, benchmarks/rollout.py)
  chain = matmul_limit(policy, pool, params, args.slots, args.chunk, attend=int(round(span)))
  chain()
  chain_s = min(timed_call(chain) for _ in range(3)) / args.chunk
  where = profile(lambda: run(3)) if args.profile else None
  return dict(params=param_count(cfg), slots=args.slots, prompt=args.prompt, new_tokens=args.new,
              compile_and_first_run_s=round(compile_s, 2), decode_step_ms=round(step_s * 1e3, 3),
              decode_tokens_per_s=round(args.slots / step_s, 1), weight_bytes_read=weight_bytes,
              kv_cache_bytes=kv_bytes, columns_attended=round(span, 1), bytes_per_step=bytes_per_step,
              achieved_gb_per_s=round(bytes_per_step / step_s / 1e9, 1), copy_gb_per_s=round(bandwidth / 1e9, 1),
              roofline_share=round(bytes_per_step / step_s / bandwidth,
                                   3), matmul_chain_step_ms=round(chain_s * 1e3, 3),
              chain_roofline_share=round(bytes_per_step / chain_s / bandwidth,
                                         3), ours_over_chain=round(chain_s / step_s, 3), profile=where)


CPU_BOOKKEEPING = ("ThunkExecutor", "end: ")  # XLA:CPU's events around and after its ops
MATMUL_KERNELS = ("gemm", "dot", "cublas", "cutlass", "matmul", "ynn_fusion", "wgmma")


def profile(fn, top=12) -> dict:
  """fn() once under jax.profiler -> where the device's time went: the kernels (XLA:GPU, one
  event per kernel on the device's streams; on a CPU the XLA threads' ops) by total time, their
  share of the device's busy time, the share of kernels whose names say matmul, and busy time
  over the traced wall time (what is left is the device waiting on the host)."""
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      t0 = time.perf_counter()
      fn()
      wall = time.perf_counter() - t0
    path = next(os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs if f.endswith(".trace.json.gz"))
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  kernels = collections.defaultdict(lambda: [0, 0.0])  # name -> [count, microseconds]
  for e in _leaves(_device_ops(events)):
    name = "/".join(filter(None, (e.get("args", {}).get("hlo_module"), e["name"])))  # program/op where known
    kernels[name][0] += 1
    kernels[name][1] += e.get("dur", 0)
  busy = sum(us for _, us in kernels.values()) or 1.0
  matmul = sum(us for name, (_, us) in kernels.items() if any(k in name.lower() for k in MATMUL_KERNELS))
  ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
  return dict(wall_ms=round(wall * 1e3, 2), busy_ms=round(busy / 1e3, 2), busy_over_wall=round(busy / 1e6 / wall, 3),
              matmul_share=round(matmul / busy, 3),
              top=[[name, count, round(us / 1e3, 3), round(us / busy, 3)] for name, (count, us) in ranked])


def _device_ops(events) -> list:
  """A trace's complete events of the device's work: a GPU's stream lines (its process also has
  "XLA Modules" and "XLA Ops" lines spanning the same kernels), else the device's process, else (a
  CPU) every thread but Python's, less XLA:CPU's bookkeeping events."""
  named = lambda kind: {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("name") == kind}
  devices = {pid for (pid, _), name in named("process_name").items() if name.startswith("/device:")}
  threads = named("thread_name")
  streams = {key for key, name in threads.items() if key[0] in devices and name.startswith("Stream")}
  if streams:
    ours = lambda e: (e["pid"], e["tid"]) in streams
  elif devices:
    ours = lambda e: e["pid"] in devices
  else:
    ours = lambda e: threads.get((e["pid"], e["tid"])) != "python" and not e["name"].startswith(CPU_BOOKKEEPING)
  return [e for e in events if e.get("ph") == "X" and ours(e)]


def _leaves(events) -> list:
  """The events that enclose no other event of their thread (XLA:CPU nests an executable's ops in
  its run; a GPU stream's kernels do not nest), so their times add up without counting twice."""
  by_thread, leaves = collections.defaultdict(list), []
  for e in events:
    by_thread[e["pid"], e["tid"]].append(e)
  for thread in by_thread.values():
    thread.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    for e, following in zip(thread, thread[1:] + [None]):
      if following is None or following["ts"] >= e["ts"] + e.get("dur", 0):
        leaves.append(e)
  return leaves


def timed_call(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def step_flops(cfg, rows, length) -> float:
  """Model FLOPs of one update on rows x length tokens: 6 per matmul weight per token (forward and
  both backward products) and causal attention (QK^T and PV over length/2 keys on average)."""
  from jaxrl_hex.models.config import param_count
  matmul_params = param_count(cfg) - cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
  matmul_params += cfg.vocab_size * cfg.d_model  # the output head is a matmul, the embedding a lookup
  matmul_params -= (2 * cfg.n_layers + 1) * cfg.d_model  # RMSNorm scales
  attention = 2 * 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * (length / 2)
  return 3 * rows * length * (2 * matmul_params + attention)


def grpo_trainer(policy, pool, params):
  """The real Trainer with GRPO's decoupled PPO loss (token mean) and AdamW at a small lr."""
  import ml_collections

  from jaxrl_hex.config import base_config
  from jaxrl_hex.rl.objectives import make_rl_loss
  from jaxrl_hex.rl.trainer import Trainer, make_optimizer
  optim = ml_collections.ConfigDict(
      dict(lr=1e-6, warmup_steps=0, end_lr_ratio=1.0, b1=0.9, b2=0.999, weight_decay=0.0, grad_clip=1.0))
  algo = base_config().algo
  algo.update(dict(loss_agg="token-mean", clip_eps_high=0.2, share_prompts=False))
  return Trainer(policy, pool, make_optimizer(optim, 100), make_rl_loss(algo, 1.0), params)


def part_train(model, args) -> dict:
  from jaxrl_hex.rl.batch import TrainBatch
  cfg, pool, policy, params = build(dict(model, remat=args.remat))
  trainer = grpo_trainer(policy, pool, params)
  rng = np.random.default_rng(0)
  n, width, completion = args.rows, args.length, args.length // 2
  batch = TrainBatch(tokens=rng.integers(3, cfg.vocab_size, (n, width)).astype(np.int32), valid=np.ones(
      (n, width), bool), loss_mask=np.ones((n, completion), bool), behav_logp=np.full(
          (n, completion), -8.0, np.float32), rewards=rng.normal(size=n).astype(np.float32),
                     group_ids=np.arange(n, dtype=np.int32), versions=np.zeros((n, completion), np.int32))
  t0 = time.perf_counter()
  trainer.step(batch)
  first = time.perf_counter() - t0
  times = []
  for _ in range(args.train_steps):
    t0 = time.perf_counter()
    trainer.step(batch)
    times.append(time.perf_counter() - t0)
  step_s = float(np.median(times))
  flops = step_flops(cfg, n, width)
  where = profile(lambda: jax.block_until_ready(trainer.step(batch))) if args.profile else None
  peak, measured = peak_flops(jax.devices()[0]), matmul_flops(args.matmul_n)
  return dict(rows=n, length=width, remat=args.remat, first_step_s=round(first, 2), step_s=round(step_s, 4),
              train_tokens_per_s=round(n * width / step_s, 1), model_tflop_per_step=round(flops / 1e12, 3),
              achieved_tflops=round(flops / step_s / 1e12,
                                    2), peak_tflops=None if peak is None else round(peak / 1e12, 1),
              mfu=None if peak is None else round(flops / step_s / peak, 3),
              matmul_tflops_measured=round(measured / 1e12, 2), share_of_matmul=round(flops / step_s / measured,
                                                                                      3), profile=where)


def part_sync(model, args) -> dict:
  from jaxrl_hex.models.policy import param_bytes
  from jaxrl_hex.sync import make_sync, shared_memory
  from jaxrl_hex.sync.direct import rollout_layouts
  _, pool, policy, params = build(model)
  shardings = pool.shardings_for(policy.logical_axes(), policy.shapes())
  nbytes = param_bytes(params)
  out = dict(bytes=nbytes, copy_gb_per_s=round(copy_rate(args.copy_bytes) / 1e9, 1))
  with tempfile.TemporaryDirectory() as tmp:
    methods = ["device_put"]
    try:
      import orbax.checkpoint  # noqa: F401  (absent from a bare accelerator image)
      methods.append("orbax")
      from cluster import disk_seconds  # benchmarks/cluster.py
      out["disk_gb_per_s"] = round(nbytes / disk_seconds(nbytes, tmp)[0] / 1e9, 2)
    except ImportError:
      out["orbax"] = "not installed"
    if shared_memory.room() > shared_memory.SLOTS * nbytes:
      methods.append("direct shared memory")  # another process's layout, through the host: no bound here
    for method in methods:
      if method == "direct shared memory":
        publisher = make_sync("direct", policy.shapes(), None, layouts=rollout_layouts([pool.spec],
                                                                                       policy.logical_axes(),
                                                                                       policy.shapes()))
        receiver = make_sync("direct", policy.shapes(), shardings)
      else:
        publisher = receiver = make_sync(method, policy.shapes(), shardings, os.path.join(tmp, "sync"))
      seconds = []
      for v in range(3):  # the first round compiles / warms caches
        t0 = time.perf_counter()
        _, got = receiver.receive(publisher.publish(v, params))
        jax.block_until_ready(got)
        seconds.append(time.perf_counter() - t0)
        del got
      publisher.close()
      s = min(seconds[1:])
      out[method] = dict(seconds=round(s, 4), gb_per_s=round(nbytes / s / 1e9, 2))
      bound = dict(device_put=out["copy_gb_per_s"], orbax=out.get("disk_gb_per_s")).get(method)
      if bound:
        out[method]["share_of_bound"] = round(nbytes / s / 1e9 / bound, 3)
  return out


def decode_weight_bytes(params, slots: int, compute_dtype) -> int:
  """Weight bytes one decode step must read: every weight at the compute dtype (XLA may cast a
  loop-invariant weight once, outside the steps) but the embedding table, of which only the slots'
  rows."""
  embed = params["embed"]
  count = sum(x.size for x in jax.tree.leaves(params)) - embed.size + slots * embed.shape[1]
  return count * jnp.dtype(compute_dtype).itemsize


def part_rl(model, args) -> dict:
  """One GRPO step per RL_MODELS shape (SMOKE's with --smoke): sync, rollout, train, in that order,
  --rl-steps times; the first compiles, the figures are the later steps' medians."""
  out = {}
  for name, shape in ({"smoke": model} if args.smoke else RL_MODELS).items():
    try:
      out[name] = rl_step(shape, args)
    except Exception as e:  # noqa: BLE001  (the 1.5B shape failing must not lose the 0.5B's figures)
      traceback.print_exc()
      out[name] = dict(error=f"{type(e).__name__}: {e}")
    print(json.dumps({"rl": {name: out[name]}}), flush=True)
  return out


def rl_step(model, args) -> dict:
  from jaxrl_hex import meshes
  from jaxrl_hex.models.config import model_config, param_count
  from jaxrl_hex.models.policy import Policy, param_bytes
  from jaxrl_hex.rl.batch import rl_batch
  from jaxrl_hex.rollout.engine import Engine
  from jaxrl_hex.sync import make_sync
  pools = meshes.build_pools(meshes.load_mesh_file(SINGLE))
  cfg = model_config(**model)
  policy = Policy.build(cfg)
  axes, shapes = policy.logical_axes(), policy.shapes()
  trainer = grpo_trainer(policy, pools["train"], random_params(shapes, pools["train"].shardings_for(axes, shapes)))
  rows = args.rl_prompts * args.rl_group
  engine = Engine(policy, pools["rollout"], Tok(cfg.vocab_size), args.rl_new, temperature=1.0, slots=rows,
                  max_prompt_len=args.rl_prompt, steps_per_sync=args.chunk)
  sync = make_sync("device_put", shapes, engine.param_shardings)
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, cfg.vocab_size, args.rl_prompt - 1).tolist() for _ in range(args.rl_prompts)]
  steps = []
  for version in range(args.rl_steps):
    t0 = time.perf_counter()
    _, weights = sync.receive(sync.publish(version, trainer.params))
    engine.load_weights(version, jax.block_until_ready(weights))
    sync.settle()  # the copy out of the params is done before the trainer's step donates them
    t1 = time.perf_counter()
    rollout = engine.generate(prompts, args.rl_group, jax.random.key(version))
    rollout.rewards = rng.normal(size=rows).astype(np.float32)
    t2 = time.perf_counter()
    trainer.step(rl_batch(rollout))
    steps.append((t1 - t0, t2 - t1, time.perf_counter() - t2, int(rollout.completion_mask.sum())))
  sync_s, rollout_s, train_s, new_tokens = (float(np.median(x)) for x in zip(*steps[1:]))
  bandwidth = 2 * copy_rate(args.copy_bytes)  # read + written bytes per second
  # a sequence's decode steps attend from its prompt to its last token: the prompt + half the new ones on average
  columns = args.rl_prompt + args.rl_new / 2
  kv_bytes = engine.memory["kv_cache_bytes"] * columns / engine.length
  step_bytes = int(decode_weight_bytes(trainer.params, rows, cfg.dtype) + kv_bytes)
  rollout_rate, roofline = new_tokens / rollout_s, rows * bandwidth / step_bytes
  length = args.rl_prompt + args.rl_new
  flops = step_flops(cfg, rows, length)
  achieved, peak, measured = flops / train_s, peak_flops(jax.devices()[0]), matmul_flops(args.matmul_n)
  return {
      "params": param_count(cfg),
      "param_bytes": param_bytes(trainer.params),
      "rows": rows,
      "prompt": args.rl_prompt,
      "new_tokens": args.rl_new,
      "first_step_s": round(sum(steps[0][:3]), 2),
      "sync_s": round(sync_s, 4),
      "rollout_s": round(rollout_s, 3),
      "train_s": round(train_s, 3),
      "rollout_tokens_per_s": round(rollout_rate, 1),
      "decode_step_bytes": step_bytes,
      "copy_gb_per_s": round(bandwidth / 1e9, 1),
      "roofline_tokens_per_s": round(roofline, 1),
      "rollout_roofline_share": round(rollout_rate / roofline, 3),
      "train_tokens_per_s": round(rows * length / train_s, 1),
      "model_tflop_per_step": round(flops / 1e12, 3),
      "achieved_tflops": round(achieved / 1e12, 2),
      "peak_tflops": None if peak is None else round(peak / 1e12, 1),
      "mfu": None if peak is None else round(achieved / peak, 3),
      "matmul_tflops_measured": round(measured / 1e12, 2),
      "share_of_matmul": round(achieved / measured, 3),
  }


def part_init(model, args) -> dict:
  """Seconds to compile Policy.init (not run: --part all draws params on the host) at three depths of
  listed layers and at full depth stacked (scan_layers), where one draw covers every layer (listed at
  full depth takes ~2 min on an H200)."""
  from jaxrl_hex.models.config import model_config
  from jaxrl_hex.models.policy import Policy
  out = {}
  for layers, stacked in ((2, False), (6, False), (model["n_layers"], False), (model["n_layers"], True)):
    policy = Policy.build(model_config(**dict(model, n_layers=layers, scan_layers=stacked)))
    t0 = time.perf_counter()
    jax.jit(lambda p=policy: p._fresh(0)).lower().compile()
    out[f"{layers}_{'stacked' if stacked else 'listed'}_compile_s"] = round(time.perf_counter() - t0, 2)
  return out


PARTS = {"decode": part_decode, "train": part_train, "sync": part_sync, "rl": part_rl, "init": part_init}
ALL = ("decode", "train", "sync", "rl")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--part", default="all", choices=(*PARTS, "all"))
  ap.add_argument("--smoke", action="store_true", help="a tiny model on any device: checks the script itself")
  ap.add_argument("--slots", type=int, default=64)
  ap.add_argument("--prompt", type=int, default=64)
  ap.add_argument("--new", type=int, default=192, help="decode: new tokens per sequence (multiple of --chunk)")
  ap.add_argument("--chunk", type=int, default=64, help="decode: steps per host hand-back")
  ap.add_argument("--rows", type=int, default=8, help="train: sequences per update")
  ap.add_argument("--length", type=int, default=2048, help="train: tokens per sequence")
  ap.add_argument("--remat", default="none", choices=("none", "full", "dots"))
  ap.add_argument("--train-steps", type=int, default=5)
  ap.add_argument("--matmul-n", type=int, default=8192)
  ap.add_argument("--rl-prompts", type=int, default=8, help="rl: prompts per step")
  ap.add_argument("--rl-group", type=int, default=8, help="rl: completions per prompt")
  ap.add_argument("--rl-prompt", type=int, default=128, help="rl: prompt tokens")
  ap.add_argument("--rl-new", type=int, default=256, help="rl: new tokens per completion (every one runs its budget)")
  ap.add_argument("--rl-steps", type=int, default=3, help="rl: steps per shape; the first compiles")
  ap.add_argument("--no-profile", dest="profile", action="store_false",
                  help="skip the profiled run of decode and train (profile(): where the device's time went)")
  ap.add_argument("--copy-bytes", type=int, default=2 << 30)
  args = ap.parse_args(argv)
  devices = jax.devices()
  print("jax", jax.__version__, "devices:", devices, flush=True)
  if args.smoke:
    args.new, args.chunk, args.slots, args.prompt = 32, 16, 8, 16
    args.rows, args.length, args.train_steps, args.matmul_n, args.copy_bytes = 2, 64, 2, 256, 64 << 20
    args.rl_prompts, args.rl_group, args.rl_prompt, args.rl_new, args.rl_steps = 2, 2, 16, 16, 2
  elif devices[0].platform != "gpu" and args.part != "init":  # init's compile times mean something anywhere
    sys.exit("gpu_check: no GPU visible to JAX (jax.devices() above); install jax with its CUDA plugin "
             "(the H200 image has jax + jax-cuda13-plugin) and rerun, or pass --smoke")
  model = SMOKE if args.smoke else MODEL
  results = dict(device=str(devices[0].device_kind), jax=jax.__version__)
  for name in ALL if args.part == "all" else (args.part,):
    t0 = time.perf_counter()
    try:
      results[name] = dict(PARTS[name](model, args), part_s=round(time.perf_counter() - t0, 1))
    except Exception as e:  # noqa: BLE001  (one part's failure must not lose the others' figures)
      traceback.print_exc()
      results[name] = dict(error=f"{type(e).__name__}: {e}")
    print(json.dumps({name: results[name]}), flush=True)
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as f:
      json.dump(results, f, indent=2)
  return 1 if failed(results) else 0


def failed(results) -> bool:
  """Whether any part, or any shape of a part, reports an error."""
  return isinstance(results, dict) and ("error" in results or any(map(failed, results.values())))


if __name__ == "__main__":
  sys.exit(main())
