"""The planner's plan for this machine, run as written: predicted vs measured rollout time after
calibrating on another workload (held out), and whether the plan learns. One run.

meshes/cluster-cpu-mixed.yaml describes this 2-core machine; meshes/plan-cpu-mixed-tiny.yaml is
`jaxrl-hex plan`'s output for it (a Ray fleet of pinned replicas). Both runs train the demo from
one warm start, synchronously (train.max_staleness=0), so a batch's routing time is the
makespan the planner predicts as rollout_s:

  fit    the plan at group_size 2 and 4 (a quarter and half the sequences per step: two
         operating points, so fixed and per-sequence costs separate): `jaxrl-hex calibrate` fits
         the catalog's factors to their train and rollout records
  plan   the plan as written (its 32 x 8 batch), a workload the fit has not seen; its measured
         rollout time (median batch makespan) against the planner's prediction for the plan's
         allocation, on the catalog before and after the fit

  python benchmarks/fleet_plan.py [--steps 60]  ->  benchmarks/out/fleet_plan.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from jaxrl_hex.calibration import calibrate_runs  # noqa: E402
from jaxrl_hex.metrics import read_jsonl  # noqa: E402
from jaxrl_hex.planner import allocate  # noqa: E402
from jaxrl_hex.planner.model_files import load_model  # noqa: E402

CLUSTER = os.path.join(ROOT, "meshes", "cluster-cpu-mixed.yaml")
PLAN = os.path.join(ROOT, "meshes", "plan-cpu-mixed-tiny.yaml")
FIT_GROUPS = (2, 4)  # the fit runs' group sizes; the held-out run is the plan's own (8)


def _cli(*args):
  subprocess.run([sys.executable, "-m", "jaxrl_hex.cli", *args], check=True, cwd=ROOT)


def _train(workdir, warm, steps, *overrides):
  _cli("train", f"--workdir={workdir}", f"--config.init_from={warm}", f"--config.mesh_file={PLAN}",
       "--config.cluster.backend=ray", "--config.sync.method=direct", "--config.train.max_staleness=0",
       f"--config.train.steps={steps}", f"--config.train.eval_every={steps}", *overrides)


def _makespans(workdir) -> list:
  """Each batch's routing time (added -> every group done), the first to finish (warm-up) left
  out, as calibration.run_records leaves it out of the batch records."""
  routes = [s for s in read_jsonl(os.path.join(workdir, "spans.jsonl")) if s["kind"] == "route"]
  return [s["end"] - s["start"] for s in routes[1:]]


def _predicted(catalog_overlay=None) -> dict:
  name, cfg = load_model("tiny")
  cluster = allocate.load_cluster(CLUSTER, catalog_overlay)
  p = allocate.predict_written(cfg, cluster, yaml.safe_load(open(PLAN)), name)
  return {"rollout_s": p.rollout_s, "train_step_s": p.train.step_s, "step_s": p.step_s}


def _scored(measured, before, after) -> dict:
  return {
      "measured": measured,
      "predicted_before": before,
      "predicted_after": after,
      "error_before": abs(before - measured) / measured,
      "error_after": abs(after - measured) / measured,
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--fit-steps", type=int, default=20)
  ap.add_argument("--workdir", help="keep the runs here; runs already finished there are reused")
  args = ap.parse_args()
  tmp = args.workdir or tempfile.mkdtemp()
  warm, held = os.path.join(tmp, "warm"), os.path.join(tmp, "plan")
  fits = {g: os.path.join(tmp, f"fit-g{g}") for g in FIT_GROUPS}
  done = lambda w: os.path.exists(os.path.join(w, "summary.json"))  # noqa: E731
  if not os.path.isdir(os.path.join(warm, "checkpoints")):
    _cli("sft", f"--workdir={warm}", "--config.sft.max_steps=400", "--config.sft.target_accuracy=0.4")
  for g, fit in fits.items():
    if not done(fit):
      _train(fit, warm, args.fit_steps, f"--config.rollout.group_size={g}")
  if not done(held):
    _train(held, warm, args.steps)

  result = calibrate_runs(list(fits.values()), held_out=[held], cluster_path=CLUSTER)
  overlay = os.path.join(tmp, "fitted.yaml")
  with open(overlay, "w") as f:
    yaml.safe_dump(result["overlay"], f)
  before, after = _predicted(), _predicted(overlay)
  measured = float(np.median(_makespans(held)))
  rows = [r for r in read_jsonl(os.path.join(held, "metrics.jsonl")) if r.get("phase") == "train"]
  train_s = float(np.median([r["train_seconds"] for r in rows if r.get("batch") is not None][1:]))
  out = {
      "steps": args.steps,
      "fit_steps": args.fit_steps,
      "overlay": result["overlay"],
      "records": {
          "fitted": result["fitted"],
          "held_out": result["held_out"]
      },
      "rollout_s": _scored(measured, before["rollout_s"], after["rollout_s"]),
      "train_step_s": _scored(train_s, before["train_step_s"], after["train_step_s"]),
      "eval_accuracy": {
          "start": rows[0]["eval_accuracy"],
          "end": rows[-1]["eval_accuracy"]
      },
  }
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  with open(os.path.join(HERE, "out", "fleet_plan.json"), "w") as f:
    json.dump(out, f, indent=1, default=str)
  r, t = out["rollout_s"], out["train_step_s"]
  print("| figure | measured | predicted (catalog) | predicted (fitted on group sizes 2, 4) | error before | "
        "error after |")
  print("|---|---|---|---|---|---|")
  for name, f in (("rollout s per batch", r), ("train step s", t)):
    print(f"| {name} | {f['measured']:.3f} | {f['predicted_before']:.3f} | {f['predicted_after']:.3f} | "
          f"{f['error_before']:.0%} | {f['error_after']:.0%} |")
  acc = out["eval_accuracy"]
  print(f"eval accuracy {acc['start']:.3f} -> {acc['end']:.3f} over {args.steps} steps")


if __name__ == "__main__":
  main()
