"""Real model sizes on the layouts the planner picks, proven by XLA: the trainer's GRPO update and
the engine's decode step compiled (never run) for Qwen2-7B, Qwen2-14B and Llama-3.1-70B on
simulated CPU devices of the layout's count, with per-device bytes from memory_analysis() next to
the planner's train_memory estimate and the device's HBM.

Cases: the planner's fastest fitting train layout (allocate.Problem.train_choice) on a TPU
v5p-32 slice and on one and two 8 x H100 hosts for each model, and the train pools of the committed plans
meshes/plan-v5p-h100-qwen2_7b.yaml and plan-v5e-v6e-qwen2_7b.yaml. The train step runs the
planner's micro-batch (rows of prompt_len + output_len.max tokens per batch shard, the plans'
plan.train) with its remat policy; the decode step one replica of the planner's rollout choice
with its slots, each holding prompt_len + output_len.mean tokens. bf16 params and activations,
scan_layers=True. And the length sweep: Qwen2.5-1.5B at 8
rows x 1k..8k tokens per micro-batch on the planner's 8 x v5e layout (the step's memory should
grow linearly with the length). Each device count runs in its own process
(XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts).

  python benchmarks/compile_sizes.py [--only qwen2_7b] [--out benchmarks/out/compile_sizes.json]
    -> the JSON and the table in benchmarks/README.md
  python benchmarks/compile_sizes.py --part fit
    -> benchmarks/out/memory_fit.json: the train step on FIT_POINTS (8-32 devices) and the
       least-squares (non-negative, on relative errors) fit of planner/cost_model.py's HEAD_BYTES,
       OPT_TEMP_BYTES and SAVED_BYTES to XLA's peak bytes, the TRAIN_MEMORY_MARGIN that covers
       its largest under-estimate, and each point's error at the committed constants
  python benchmarks/compile_sizes.py --part decode
    -> benchmarks/out/decode_fit.json and a table in benchmarks/README.md: the fp32 decode step's
       temp bytes on DECODE_POINTS against cost_model.decode_working_bytes
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLUSTER = os.path.join(ROOT, "meshes", "cluster-v5p-h100.yaml")  # the workload (prompt, output, batch)
PLANS = ("plan-v5p-h100-qwen2_7b.yaml", "plan-v5e-v6e-qwen2_7b.yaml")
MODELS = ("qwen2_7b", "qwen2_14b", "llama3_70b")
SLICES = (("v5p", 32), ("H100", 8), ("H100", 16))
# Qwen2.5-1.5B (Qwen2-1.5B's shape) GRPO on the planner's 8 x v5e (16 GB) layout at 8 rows per
# micro-batch, one per batch shard, over lengths: the train step's memory against the length.
SWEEP = dict(model="qwen2_1_5b", device_type="v5e", devices=8, lengths=(1024, 2048, 4096, 8192))
GIB = 2**30
# (model, train mesh, tokens per row, rows per batch shard, remat, sequence parallel): the points
# the planner's train_memory is fitted to.
# yapf: disable
FIT_POINTS = (
    ("qwen2_1_5b", {"data": 4, "fsdp": 2}, 4096, 1, "full", False),
    ("qwen2_1_5b", {"fsdp": 8}, 4096, 1, "full", False),
    ("qwen2_1_5b", {"fsdp": 8}, 8192, 1, "full", False),
    ("qwen2_1_5b", {"fsdp": 8}, 2048, 4, "full", False),
    ("qwen2_1_5b", {"fsdp": 4, "tensor": 2}, 4096, 1, "full", False),
    ("qwen2_1_5b", {"fsdp": 8}, 4096, 1, "dots", False),
    ("qwen2_1_5b", {"fsdp": 8}, 4096, 1, "none", False),
    ("qwen2_7b", {"fsdp": 8}, 4096, 1, "full", False),
    ("qwen2_7b", {"data": 2, "fsdp": 4}, 8192, 1, "full", False),
    ("qwen2_7b", {"fsdp": 4, "tensor": 2}, 4096, 1, "full", False),
    ("qwen2_7b", {"fsdp": 8}, 4096, 1, "dots", False),
    ("qwen2_7b", {"fsdp": 8}, 2048, 2, "none", False),
    ("qwen2_7b", {"fsdp": 4, "tensor": 2}, 16384, 1, "dots", False),
    ("qwen2_7b", {"fsdp": 8}, 16384, 1, "full", False),
    ("qwen2_14b", {"fsdp": 8}, 16384, 1, "full", False),
    ("qwen2_14b", {"data": 2, "fsdp": 4}, 8192, 2, "full", False),
    ("qwen2_14b", {"fsdp": 4, "tensor": 2}, 16384, 1, "dots", False),
    ("llama3_70b", {"fsdp": 8}, 8192, 1, "full", False),
    ("llama3_70b", {"fsdp": 8}, 16384, 1, "full", False),
    ("llama3_70b", {"fsdp": 4, "tensor": 2}, 16384, 1, "full", False),
    ("qwen2_14b", {"fsdp": 8}, 16384, 2, "full", False),
    ("qwen2_7b", {"data": 4, "fsdp": 4, "tensor": 2}, 16384, 1, "dots", False),
    ("llama3_70b", {"fsdp": 16, "tensor": 2}, 8192, 1, "full", False),
    ("llama3_70b", {"fsdp": 32}, 8192, 1, "full", False),
    ("llama3_70b", {"fsdp": 8, "tensor": 4}, 16384, 1, "full", False),
    ("qwen2_14b", {"fsdp": 8, "tensor": 4}, 16384, 1, "dots", False),
    ("qwen2_1_5b", {"fsdp": 4, "tensor": 2}, 4096, 1, "full", True),
    ("qwen2_7b", {"fsdp": 4, "tensor": 2}, 16384, 1, "full", True),
    ("qwen2_7b", {"data": 2, "fsdp": 4, "tensor": 4}, 8192, 1, "full", True),
    ("qwen2_14b", {"fsdp": 8, "tensor": 4}, 16384, 1, "full", True),
    ("llama3_70b", {"fsdp": 8, "tensor": 4}, 16384, 1, "full", True),
    ("llama3_70b", {"fsdp": 16, "tensor": 2}, 8192, 1, "full", True),
    ("llama3_70b", {"fsdp": 8, "tensor": 4}, 8192, 2, "full", True),
)
FIT_DEVICES = 32  # the fit's process simulates this many; each point's pool takes the first it needs
# (model, tensor, prompt tokens, new tokens) of the decode points: the engine's decode step in fp32
# (XLA:CPU upcasts bf16 dots, keeping fp32 copies of the weights and of the K/V it reads) at
# DECODE_SLOTS, for cost_model.DECODE_KV_COPIES and decode_working_bytes
DECODE_POINTS = (
    ("qwen2_1_5b", 1, 1024, 4096),
    ("qwen2_1_5b", 1, 256, 1024),
    ("qwen2_1_5b", 2, 1024, 4096),
    ("qwen2_7b", 1, 1024, 4096),
    ("qwen2_7b", 1, 256, 1024),
    ("qwen2_7b", 2, 256, 1024),
    ("qwen2_7b", 4, 256, 1024),
)
DECODE_SLOTS = (16, 64)
# yapf: enable


def model_cfg(name):
  from jaxrl_hex.planner.model_files import load_model
  cfg = load_model(name)[1]
  cfg.update(dtype="bfloat16", param_dtype="bfloat16", scan_layers=True, remat="full")
  return cfg


def workload():
  from jaxrl_hex.planner.cost_model import Workload
  with open(CLUSTER) as f:
    return Workload.from_dict(yaml.safe_load(f)["workload"])


def planner_train(name, dev, n, w, seq_len) -> dict:
  """The planner's train step on n chips (allocate.Problem.train_choice, rows of seq_len tokens):
  its mesh, remat and micro-batch rows per batch shard; {} if none fits."""
  from jaxrl_hex.planner import allocate
  w = dataclasses.replace(w, output_max=seq_len - w.prompt_len, output_mean=min(w.output_mean, seq_len - w.prompt_len))
  choice = allocate.Problem(model_cfg(name), allocate.Cluster({dev.name: n}, {dev.name: dev},
                                                              w)).train_choice(dev.name, n)
  if choice is None:
    return {}
  return dict(mesh=choice.layout.mesh(), remat=choice.layout.remat, sequence_parallel=choice.layout.sequence_parallel,
              rows=choice.rows)


def planner_replica(m, dev, w):
  """The planner's rollout replica on `dev`: the tensor degree with the most tokens/s per chip."""
  from jaxrl_hex.planner import cost_model as cm
  options = [r for t in cm.tensor_degrees(dev) if (r := cm.replica(m, dev, t, w))]
  return max(options, key=lambda r: r.tokens_per_s(w) / r.tensor, default=None)


def cases(only):
  """Every case as a JSON-able dict: model, device type, train mesh, rollout tensor degree and slots."""
  from jaxrl_hex.planner import cost_model as cm
  from jaxrl_hex.planner.catalog import load_catalog
  catalog, w, out = load_catalog(), workload(), []
  seq_len = w.prompt_len + w.output_max  # the planner's row: one max-length sequence
  for name in MODELS:
    if only and name not in only:
      continue
    m = cm.ModelCost.from_config(model_cfg(name))
    for kind, n in SLICES:
      train, rep = planner_train(name, catalog[kind], n, w, seq_len), planner_replica(m, catalog[kind], w)
      out.append(
          dict(model=name, device_type=kind, source=f"planner, {kind} x {n}", devices=n, seq_len=seq_len,
               **({
                   "mesh": None
               } | train), rollout_tensor=rep and rep.tensor, rollout_slots=rep and rep.slots))
  if not only or SWEEP["model"] in only:
    train = planner_train(SWEEP["model"], catalog[SWEEP["device_type"]], SWEEP["devices"], w, 4096)
    for length in SWEEP["lengths"]:  # the planner's layout for 4k, one row per batch shard
      out.append(
          dict(model=SWEEP["model"], device_type=SWEEP["device_type"], devices=SWEEP["devices"], seq_len=length,
               source=f"planner, {SWEEP['device_type']} x {SWEEP['devices']}, 8 rows x {length}",
               **(train | {
                   "rows": 8 // SWEEP["devices"]
               })))
  for plan in PLANS:
    with open(os.path.join(ROOT, "meshes", plan)) as f:
      raw = yaml.safe_load(f)
    name = raw["plan"]["model"]
    if only and name not in only:
      continue
    train, rollout = raw["pools"]["train"], raw["pools"]["rollout"]["replicas"][0]
    m = cm.ModelCost.from_config(model_cfg(name))
    pw = cm.Workload.from_dict(raw["plan"]["workload"])  # the plan's own workload
    rep = cm.replica(m, catalog[rollout["device_type"]], rollout["mesh"]["tensor"], pw)
    knobs, batch_ways, plan_len = raw["plan"][
        "train"], train["mesh"]["data"] * train["mesh"]["fsdp"], pw.prompt_len + pw.output_max
    rows = knobs["micro_batch_tokens"] // (batch_ways * plan_len) or -(-pw.sequences // batch_ways)  # 0: whole batch
    out.append(
        dict(model=name, device_type=train["device_type"], source=f"meshes/{plan}", devices=train["devices"],
             seq_len=plan_len, workload=raw["plan"]["workload"], mesh=train["mesh"], remat=knobs["remat"], rows=rows,
             sequence_parallel=(train.get("rules") or
                                {}).get("length") == "tensor", rollout_device_type=rollout["device_type"],
             rollout_tensor=rollout["mesh"]["tensor"], rollout_slots=rep and rep.slots))
  return out


def measure(case, w) -> dict:
  """In a process with the case's device count: compile the train step and the decode step
  (under the case's own workload, a plan's, where it has one, else w)."""
  from jaxrl_hex import footprint, meshes
  from jaxrl_hex.config import base_config
  from jaxrl_hex.models.policy import Policy
  from jaxrl_hex.planner import cost_model as cm
  from jaxrl_hex.planner.catalog import load_catalog
  from jaxrl_hex.rl.objectives import make_rl_loss
  from jaxrl_hex.rl.trainer import make_optimizer
  cfg, base = model_cfg(case["model"]), base_config()
  cfg.remat = case.get("remat", cfg.remat)
  w = cm.Workload.from_dict(case["workload"]) if "workload" in case else w
  policy, m, catalog = Policy.build(cfg), cm.ModelCost.from_config(cfg), load_catalog()
  seq_len, rows = case["seq_len"], case.get("rows", 1)
  out = dict(case, hbm_bytes=catalog[case["device_type"]].hbm_bytes)
  if case["mesh"] is not None:
    sp = case.get("sequence_parallel", False)
    pool = meshes.Pool(meshes.PoolSpec("train", tuple(range(case["devices"])), case["mesh"], train_rules(sp)))
    objective, tx = make_rl_loss(base.algo, 1.0), make_optimizer(base.optim, 100)
    prompt = min(w.prompt_len, seq_len // 2)
    batch = footprint.full_batch(pool.batch_ways * rows, prompt, seq_len - prompt, group_size=1)
    step = footprint.train_step(policy, pool, objective, tx, batch)
    out["train"] = {k: step[k].as_dict() for k in ("start", "update")}
    out["train_layout"] = list(step["layout"])
    layout = cm.TrainLayout(**{
        "data": 1,
        "fsdp": 1,
        "tensor": 1,
        **case["mesh"]
    }, remat=cfg.remat, sequence_parallel=sp)
    out["planner_train_bytes"] = cm.train_memory(m, layout, seq_len, rows)
    out["state_bytes"] = footprint.sharded_bytes((step["state"].params, step["state"].opt_state))
  if case.get("rollout_tensor"):
    t = case["rollout_tensor"]
    pool = meshes.Pool(meshes.PoolSpec("rollout", tuple(range(t)), {"tensor": t}, meshes.DEFAULT_RULES))
    decode = footprint.decode_step(policy, pool, int(w.output_mean), slots=case["rollout_slots"],
                                   max_prompt_len=w.prompt_len, steps_per_sync=16)
    out["decode"] = decode.as_dict()
    span, slots = w.prompt_len + int(w.output_mean), case["rollout_slots"]
    kv = m.kv_bytes_token / min(t, m.n_kv_heads)
    out["planner_decode_bytes"] = m.weight_bytes / t + slots * kv * span + cm.decode_working_bytes(m, t, slots, span)
  return out


def measure_decode_points() -> list:
  """In a process with 4 devices: XLA's temp bytes of the fp32 decode step on every DECODE_POINTS
  entry at each of DECODE_SLOTS, beside the planner's decode_working_bytes."""
  from jaxrl_hex import footprint, meshes
  from jaxrl_hex.models.policy import Policy
  from jaxrl_hex.planner import cost_model as cm
  out = []
  for name, t, prompt, new in DECODE_POINTS:
    cfg = model_cfg(name)
    cfg.update(dtype="float32", param_dtype="float32")
    policy, m = Policy.build(cfg), cm.ModelCost.from_config(cfg)
    pool = meshes.Pool(meshes.PoolSpec("rollout", tuple(range(t)), {"tensor": t}, meshes.DEFAULT_RULES))
    temps = [
        footprint.decode_step(policy, pool, new, slots=n, max_prompt_len=prompt, steps_per_sync=16).temp_bytes
        for n in DECODE_SLOTS
    ]
    span = prompt + new
    layer_kv = m.kv_bytes_token / min(t, m.n_kv_heads) / m.n_layers * span  # one slot's K + V of one layer
    slope = (temps[1] - temps[0]) / (DECODE_SLOTS[1] - DECODE_SLOTS[0])
    out.append(
        dict(model=name, tensor=t, span=span, slots=DECODE_SLOTS, xla_temp_bytes=temps, kv_copies=slope / layer_kv,
             layer_weight_copies=(temps[0] - slope * DECODE_SLOTS[0]) / (m.layer_weight_bytes / t),
             planner_bytes=[cm.decode_working_bytes(m, t, n, span) for n in DECODE_SLOTS]))
  return out


def decode_table(points) -> str:
  rows = [
      "| model | tensor | tokens per slot | K/V copies per slot (fit) | layer weight copies (fit) | "
      f"XLA temp GiB at {DECODE_SLOTS[1]} slots | planner GiB | planner / XLA |", "|---|---|---|---|---|---|---|---|"
  ]
  for p in points:
    xla, planner = p["xla_temp_bytes"][1], p["planner_bytes"][1]
    rows.append(f"| {p['model']} | {p['tensor']} | {p['span']} | {p['kv_copies']:.2f} | {p['layer_weight_copies']:.2f} "
                f"| {gib(xla)} | {gib(planner)} | {planner / xla:.2f} |")
  return "\n".join(rows)


def measure_fit_points() -> list:
  """In a process with FIT_DEVICES devices: XLA's peak bytes of the update on every FIT_POINTS entry."""
  import numpy as np

  from jaxrl_hex import footprint, meshes
  from jaxrl_hex.config import base_config
  from jaxrl_hex.models.policy import Policy
  from jaxrl_hex.rl.objectives import make_rl_loss
  from jaxrl_hex.rl.trainer import make_optimizer
  base, out = base_config(), []
  for name, mesh, seq_len, rows, remat, sp in FIT_POINTS:
    cfg = model_cfg(name)
    cfg.remat = remat
    devices = tuple(range(int(np.prod(list(mesh.values())))))
    pool = meshes.Pool(meshes.PoolSpec("train", devices, mesh, train_rules(sp)))
    prompt = min(1024, seq_len // 2)
    batch = footprint.full_batch(pool.batch_ways * rows, prompt, seq_len - prompt, group_size=1)
    step = footprint.train_step(Policy.build(cfg), pool, make_rl_loss(base.algo, 1.0), make_optimizer(base.optim, 100),
                                batch)
    out.append(
        dict(model=name, mesh=mesh, seq_len=seq_len, rows=rows, remat=remat, sequence_parallel=sp,
             peak_bytes=step["update"].peak_bytes))
  return out


def fit(points) -> dict:
  """Non-negative least squares of (peak - state) on cost_model.train_memory's terms."""
  import numpy as np
  from scipy.optimize import nnls

  from jaxrl_hex.planner import cost_model as cm
  features, targets, states = [], [], []
  for p in points:
    m = cm.ModelCost.from_config(model_cfg(p["model"]))
    sp = p["sequence_parallel"]
    layout = cm.TrainLayout(**{"data": 1, "fsdp": 1, "tensor": 1, **p["mesh"]}, remat=p["remat"], sequence_parallel=sp)
    shards, t = layout.fsdp * layout.tensor, layout.tensor
    token_layers = p["rows"] * p["seq_len"] * m.n_layers
    features.append(
        [m.vocab * m.d_model / t, m.params / shards] +
        [token_layers * w * (p["remat"] == r and not sp) for r in cm.REMATS for w in (m.d_model, m.mlp_dim / t)] +
        [token_layers * m.d_model / t * sp])
    states.append(4 * m.weight_bytes / shards)
    targets.append(p["peak_bytes"] - states[-1])
    p["planner_bytes"] = cm.train_memory(m, layout, p["seq_len"], p["rows"])
    p["planner_error"] = p["planner_bytes"] / p["peak_bytes"] - 1
  peaks = np.array([p["peak_bytes"] for p in points], float)
  # relative errors count alike: each row divided by its peak
  coef, _ = nnls(np.array(features) / peaks[:, None], np.array(targets) / peaks)
  errors = (np.array(features) @ coef + np.array(states)) / peaks - 1
  fitted = dict(HEAD_BYTES=coef[0], OPT_TEMP_BYTES=coef[1], SAVED_BYTES={
      r: tuple(coef[2 + 2 * i:4 + 2 * i]) for i, r in enumerate(cm.REMATS)
  }, SP_SAVED_BYTES=coef[-1], TRAIN_MEMORY_MARGIN=1 / (1 + min(errors.min(), 0)) - 1)
  committed = dict(HEAD_BYTES=cm.HEAD_BYTES, OPT_TEMP_BYTES=cm.OPT_TEMP_BYTES, SAVED_BYTES=cm.SAVED_BYTES,
                   SP_SAVED_BYTES=cm.SP_SAVED_BYTES, TRAIN_MEMORY_MARGIN=cm.TRAIN_MEMORY_MARGIN)
  return dict(fitted=fitted, committed=committed, points=points)


def train_rules(sequence_parallel: bool) -> dict:
  from jaxrl_hex import meshes
  return dict(meshes.DEFAULT_RULES, **({"length": ("tensor",)} if sequence_parallel else {}))


def gib(b):
  return f"{b / GIB:.1f}"


def table(results) -> str:
  rows = [
      "| model | layout (source) | train mesh, rows x tokens per shard, remat "
      "| train step XLA GiB/dev (state) | planner GiB/dev | XLA / planner "
      "| HBM GiB | fits | compile s (update) | decode: tensor x slots | decode XLA GiB/dev | planner GiB/dev "
      "| compile s (decode) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  ]
  for r in results:
    hbm = r["hbm_bytes"]
    if "train" in r:
      peak = r["train"]["update"]["peak_bytes"]
      mesh = "x".join(f"{k[0]}{v}" for k, v in r["mesh"].items())
      mesh += f", {r.get('rows', 1)} x {r['seq_len']}, remat {r.get('remat', 'full')}"
      mesh += ", sequence parallel" if r.get("sequence_parallel") else ""
      train = (f"{mesh} | {gib(peak)} ({gib(r['state_bytes'])}) | {gib(r['planner_train_bytes'])} | "
               f"{peak / r['planner_train_bytes']:.2f} | {gib(hbm)} | {'yes' if peak <= hbm else 'NO'} | "
               f"{r['train']['update']['compile_seconds']:.0f}")
    else:
      train = f"none fits | {r.get('error', '-')} | - | - | {gib(hbm)} | - | -"
    if "decode" in r:
      d = r["decode"]
      decode = (f"{r.get('rollout_device_type', r['device_type'])} {r['rollout_tensor']} x {r['rollout_slots']} | "
                f"{gib(d['peak_bytes'])} | {gib(r['planner_decode_bytes'])} | {d['compile_seconds']:.0f}")
    else:
      decode = "- | - | - | -"
    rows.append(f"| {r['model']} | {r['source']} | {train} | {decode} |")
  return "\n".join(rows)


def device_env(n):
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}")


def run_case(case, timeout) -> dict:
  env = device_env(case["devices"])
  t0 = time.perf_counter()
  try:
    done = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], env=env, capture_output=True,
                          text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(case, error=f"compile over {timeout:.0f} s")
  if done.returncode:
    return dict(case, error=done.stderr.strip().splitlines()[-1][:200])
  return dict(json.loads(done.stdout.strip().splitlines()[-1]), wall_seconds=time.perf_counter() - t0)


def main():
  from readme_section import write_section  # benchmarks/ is on the path when run as a script
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", nargs="*", choices=MODELS + (SWEEP["model"],), help="models to measure (default: all)")
  ap.add_argument("--out", default=os.path.join(HERE, "out", "compile_sizes.json"))
  ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case (one process)")
  ap.add_argument("--part", choices=("sizes", "fit", "decode"), default="sizes")
  ap.add_argument("--case", help=argparse.SUPPRESS)  # the worker: one case, in its own process
  args = ap.parse_args()
  if args.case:
    case = json.loads(args.case)
    parts = {"fit": measure_fit_points, "decode": measure_decode_points}
    print(json.dumps(parts[case]() if isinstance(case, str) else measure(case, workload())))
    return
  if args.part == "decode":
    done = subprocess.run([sys.executable, __file__, "--case", '"decode"'], env=device_env(4), capture_output=True,
                          text=True, check=True)
    points = json.loads(done.stdout.strip().splitlines()[-1])
    path = os.path.join(HERE, "out", "decode_fit.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump(points, f, indent=2)
    text = decode_table(points)
    print(text)
    write_section("decode-memory", text, "The decode step's working set (benchmarks/compile_sizes.py --part decode)")
    return
  if args.part == "fit":
    done = subprocess.run([sys.executable, __file__, "--case", '"fit"'], env=device_env(FIT_DEVICES),
                          capture_output=True, text=True, check=True)
    result = fit(json.loads(done.stdout.strip().splitlines()[-1]))
    path = os.path.join(HERE, "out", "memory_fit.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("fitted", "committed")}, indent=1))
    for p in result["points"]:
      print(f"{p['model']:11} {p['mesh']} {p['rows']} x {p['seq_len']:5} {p['remat']:4}  XLA "
            f"{gib(p['peak_bytes']):>5} GiB  planner {gib(p['planner_bytes']):>5} GiB  {p['planner_error']:+.0%}")
    return
  results = []
  for case in cases(args.only):
    result = run_case(case, args.timeout)
    print(json.dumps({k: v for k, v in result.items() if k not in ("train", "decode")}), flush=True)
    results.append(result)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=2)
  text = table(results)
  print(text)
  if not args.only:
    write_section("compile-sizes", text, "Real model sizes, proven by XLA (benchmarks/compile_sizes.py)")


if __name__ == "__main__":
  main()
