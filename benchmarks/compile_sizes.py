"""Real model sizes on the layouts the planner picks, proven by XLA: the trainer's GRPO update and
the engine's decode step compiled (never run) for Qwen2-7B, Qwen2-14B and a Llama-70B shape on
simulated CPU devices of the layout's count, with per-device bytes from memory_analysis() next to
the planner's train_memory estimate and the device's HBM.

Cases: the planner's fastest fitting train layout (cost_model.train_layouts, train_time) on a TPU
v5p-32 slice and on 8 x H100 for each model, and the train pools of the committed plans
meshes/plan-v5p-h100-qwen2_7b.yaml and plan-v5e-v6e-qwen2_7b.yaml. The train step runs one row of
SEQ_LEN tokens per batch shard (the planner's micro-batch); the decode step one replica of the
planner's rollout choice with its slots, each holding prompt_len + output_len.mean tokens. bf16
params and activations, scan_layers=True, remat="full". Each device count runs in its own process
(XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts).

  python benchmarks/compile_sizes.py [--only qwen2_7b] [--out benchmarks/out/compile_sizes.json]
    -> the JSON and the table in benchmarks/README.md
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BEGIN, END = "<!-- compile-sizes:begin -->", "<!-- compile-sizes:end -->"
SEQ_LEN = 4096  # tokens per row of the train micro-batch, one row per batch shard
CLUSTER = os.path.join(ROOT, "meshes", "cluster-v5p-h100.yaml")  # the workload (prompt, output, batch)
PLANS = ("plan-v5p-h100-qwen2_7b.yaml", "plan-v5e-v6e-qwen2_7b.yaml")
LLAMA_70B = dict(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, mlp_dim=28672,
                 tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=8192)
MODELS = ("qwen2_7b", "qwen2_14b", "llama_70b")
SLICES = (("v5p", 32), ("H100", 8))
GIB = 2**30


def model_cfg(name):
  from jaxrl_hex.models.config import model_config
  from jaxrl_hex.planner.model_files import load_model
  cfg = model_config(**LLAMA_70B) if name == "llama_70b" else load_model(name)[1]
  cfg.update(dtype="bfloat16", param_dtype="bfloat16", scan_layers=True, remat="full")
  return cfg


def workload():
  from jaxrl_hex.planner.cost_model import Workload
  with open(CLUSTER) as f:
    return Workload.from_dict(yaml.safe_load(f)["workload"])


def planner_layout(m, dev, n, w):
  """The planner's train layout of n chips: the fastest that fits (allocate.Problem.train_choice)."""
  from jaxrl_hex.planner import cost_model as cm
  layouts = list(cm.train_layouts(m, dev, n, SEQ_LEN, w.sequences))
  if not layouts:
    return None
  return min(layouts, key=lambda t: cm.train_time(m, dev, t, w.trained_tokens, SEQ_LEN).total_s)


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
  for name in MODELS:
    if only and name not in only:
      continue
    m = cm.ModelCost.from_config(model_cfg(name))
    for kind, n in SLICES:
      layout, rep = planner_layout(m, catalog[kind], n, w), planner_replica(m, catalog[kind], w)
      out.append(
          dict(model=name, device_type=kind, source=f"planner, {kind} x {n}", devices=n,
               mesh=None if layout is None else layout.mesh(), rollout_tensor=rep and rep.tensor, rollout_slots=rep and
               rep.slots))
  for plan in PLANS:
    with open(os.path.join(ROOT, "meshes", plan)) as f:
      raw = yaml.safe_load(f)
    name = raw["plan"]["model"]
    if only and name not in only:
      continue
    train, rollout = raw["pools"]["train"], raw["pools"]["rollout"]["replicas"][0]
    m = cm.ModelCost.from_config(model_cfg(name))
    rep = cm.replica(m, catalog[rollout["device_type"]], rollout["mesh"]["tensor"], w)
    out.append(
        dict(model=name, device_type=train["device_type"], source=f"meshes/{plan}", devices=train["devices"],
             mesh=train["mesh"], rollout_device_type=rollout["device_type"], rollout_tensor=rollout["mesh"]["tensor"],
             rollout_slots=rep and rep.slots))
  return out


def measure(case, w) -> dict:
  """In a process with the case's device count: compile the train step and the decode step."""
  from jaxrl_hex import footprint, meshes
  from jaxrl_hex.config import base_config
  from jaxrl_hex.models.policy import Policy
  from jaxrl_hex.planner import cost_model as cm
  from jaxrl_hex.planner.catalog import load_catalog
  from jaxrl_hex.rl.objectives import make_rl_loss
  from jaxrl_hex.rl.trainer import make_optimizer
  cfg, base = model_cfg(case["model"]), base_config()
  policy, m, catalog = Policy.build(cfg), cm.ModelCost.from_config(cfg), load_catalog()
  out = dict(case, hbm_bytes=catalog[case["device_type"]].hbm_bytes, seq_len=SEQ_LEN)
  if case["mesh"] is not None:
    pool = meshes.Pool(meshes.PoolSpec("train", tuple(range(case["devices"])), case["mesh"], meshes.DEFAULT_RULES))
    objective, tx = make_rl_loss(base.algo, 1.0), make_optimizer(base.optim, 100)
    rows = pool.batch_ways  # one row of SEQ_LEN per batch shard
    prompt = w.prompt_len
    batch = footprint.full_batch(rows, prompt, SEQ_LEN - prompt, group_size=1)
    step = footprint.train_step(policy, pool, objective, tx, batch)
    out["train"] = {k: step[k].as_dict() for k in ("start", "update")}
    out["train_layout"] = list(step["layout"])
    out["planner_train_bytes"] = cm.train_memory(m, cm.TrainLayout(**case["mesh"]), SEQ_LEN)
    out["state_bytes"] = footprint.sharded_bytes((step["state"].params, step["state"].opt_state))
  if case.get("rollout_tensor"):
    t = case["rollout_tensor"]
    pool = meshes.Pool(meshes.PoolSpec("rollout", tuple(range(t)), {"tensor": t}, meshes.DEFAULT_RULES))
    decode = footprint.decode_step(policy, pool, int(w.output_mean), slots=case["rollout_slots"],
                                   max_prompt_len=w.prompt_len, steps_per_sync=16)
    out["decode"] = decode.as_dict()
    kv = m.kv_bytes_token / min(t, m.n_kv_heads)
    out["planner_decode_bytes"] = m.weight_bytes / t + case["rollout_slots"] * kv * (w.prompt_len + w.output_mean)
  return out


def gib(b):
  return f"{b / GIB:.1f}"


def table(results) -> str:
  rows = [
      "| model | layout (source) | train mesh | train step XLA GiB/dev (state) | planner GiB/dev | XLA / planner "
      "| HBM GiB | fits | compile s (update) | decode: tensor x slots | decode XLA GiB/dev | planner GiB/dev "
      "| compile s (decode) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  ]
  for r in results:
    hbm = r["hbm_bytes"]
    if "train" in r:
      peak = r["train"]["update"]["peak_bytes"]
      mesh = "x".join(f"{k[0]}{v}" for k, v in r["mesh"].items())
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


def write_readme(text):
  path = os.path.join(HERE, "README.md")
  body = open(path).read()
  section = f"{BEGIN}\n{text}\n{END}"
  if BEGIN not in body:
    raise SystemExit(f"{path}: no {BEGIN} ... {END} block to rewrite")
  with open(path, "w") as f:
    f.write(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, body, flags=re.S))


def run_case(case, timeout) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={case['devices']}")
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
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", nargs="*", choices=MODELS, help="models to measure (default: all)")
  ap.add_argument("--out", default=os.path.join(HERE, "out", "compile_sizes.json"))
  ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case (one process)")
  ap.add_argument("--case", help=argparse.SUPPRESS)  # the worker: one case, in its own process
  args = ap.parse_args()
  if args.case:
    print(json.dumps(measure(json.loads(args.case), workload())))
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
    write_readme(text)


if __name__ == "__main__":
  main()
