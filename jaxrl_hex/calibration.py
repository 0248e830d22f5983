"""`jaxrl-hex calibrate WORKDIR...`: fit the planner's efficiency factors to a cluster's own runs.

Every run records what the cost model predicts: its train pool's step (tokens per step, packed
row length, tokens/s) and its rollout side's decoding (sequences per replica, their context,
tokens/s per replica group). Those become calibration records (planner/calibrate.py's format),
the factors of each device type are fitted to them, and the fitted catalog overlay is written
for `jaxrl-hex plan --catalog`. Runs passed with --held-out are scored, not fitted: their error
after the fit is the planner's error on a workload it has not seen.

  jaxrl-hex calibrate runs/a runs/b --held-out runs/c --out fitted.yaml [--cluster meshes/cluster-X.yaml]
                     [--catalog overlay.yaml] [--measured extra.json]
"""
import json
import os

import numpy as np
import yaml

from jaxrl_hex import arguments
from jaxrl_hex.config import read_run_config
from jaxrl_hex.errors import UserError
from jaxrl_hex.meshes import ReplicaGroup
from jaxrl_hex.metrics import read_jsonl
from jaxrl_hex.planner import PlanError, allocate, calibrate as cal
from jaxrl_hex.planner.catalog import load_catalog
from jaxrl_hex.runtime import load_mesh
from jaxrl_hex.tasks import load_task

PROMPT_SAMPLE = 1000  # training prompts tokenized for a run's mean prompt length


def _median(rows, key):
  values = [r[key] for r in rows if r.get(key) is not None]
  return float(np.median(values)) if values else None


def _batch_record(routes, gi, g, slots, r, prompt_len, rows, model, mesh_file, workdir) -> dict:
  """Group gi's part of a synchronous step: per batch (the first to finish, warm-up, left out) its
  busiest replica's prompts and busy seconds, the medians over batches."""
  busiest = [max((rep for rep in s["replicas"] if rep["group"] == gi), key=lambda rep: rep["busy_s"]) for s in routes]
  return {
      "pool": "rollout_batch",
      "device_type": g.device_type or mesh_file.platform,
      "devices": g.devices,
      "mesh": {
          "data": g.axes.get("data", 1),
          "tensor": g.axes.get("tensor", 1)
      },
      "model": model,
      "sequences": int(np.median([rep["prompts"] for rep in busiest])) * r.group_size,
      "group_size": r.group_size,
      "prompt_len": prompt_len,
      "output_mean": _median(rows, "response_length_mean"),
      "output_max": r.max_new_tokens,
      "slots": slots,
      "seconds": float(np.median([rep["busy_s"] for rep in busiest])),
      "run": workdir,
  }


def run_records(workdir: str) -> list:
  """Calibration records of one run: its train step, and its decoding per rollout replica group.
  The first train step (compiles) is left out. On the Ray backend (route spans) a group is timed
  by its replicas' decode step time (the decode programs alone, as the cost model's step is);
  a local run's one rollout runtime by its batches' generation as the run saw it (prefill and
  partly filled slots included). A synchronous Ray run (train.max_staleness=0) also gives each
  group's batch time (rollout_batch: its rollout overhead beyond prefill and decode)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path) or not os.path.exists(os.path.join(workdir, "config.json")):
    raise UserError(f"calibrate: {workdir} has no metrics.jsonl and config.json; pass the workdir of a train run")
  cfg = read_run_config(workdir)
  rows = [r for r in read_jsonl(path) if r.get("phase") == "train" and r.get("batch") is not None][1:]
  if not rows:
    raise UserError(f"calibrate: {workdir} logged fewer than 2 train steps; let the run go longer")
  mesh_file = load_mesh(cfg)
  model = cfg.model.to_dict()
  out = []
  train = mesh_file.pools["train"]
  tokens = [r["train_tokens_per_s"] * r["train_seconds"] for r in rows]
  slots = [t / (1.0 - r["padding_share"]) for t, r in zip(tokens, rows)]  # token slots computed
  out.append({
      "pool": "train",
      "device_type": train.device_type or mesh_file.platform,
      "devices": len(train.device_ids),
      "mesh": dict(train.axes),
      "model": model,
      "seq_len": int(round(float(np.median([s / r["pack_rows"] for s, r in zip(slots, rows)])))),
      "tokens_per_step": int(round(float(np.median(tokens)))),
      "tokens_per_s": _median(rows, "train_tokens_per_s"),
      "run": workdir,
  })
  r = cfg.rollout
  task = load_task(cfg.task, cfg)
  prompts = task.train[:PROMPT_SAMPLE]
  prompt_len = float(np.mean([len(task.tokenizer.encode(p["prompt"])) + 1 for p in prompts]))
  context = prompt_len + _median(rows, "response_length_mean") / 2  # mean length while decoding
  rollout = mesh_file.pools["rollout"]
  spans = os.path.join(workdir, "spans.jsonl")
  # in the order batches finished (a batch routed to a replica still starting may finish last)
  routes = [s for s in (read_jsonl(spans) if os.path.exists(spans) else []) if s["kind"] == "route"]
  last = {}  # per replica of a Ray rollout side, its "decoded" counts since the start (the last route span)
  for span in routes:
    for rep in span["replicas"]:
      last[rep["replica"]] = rep
  if last:  # Ray: per replica group (one mesh's replicas are one group), its replicas' decode step time
    groups = rollout.groups or [ReplicaGroup(rollout.device_type, rollout.replicas, dict(rollout.axes))]
    for gi, g in enumerate(groups):
      reps = [rep for rep in last.values() if rep["group"] == gi and rep["decoded"]["slot_steps"]]
      if not reps:
        continue
      slots = reps[0]["slots"]
      steps = sum(rep["decoded"]["slot_steps"] for rep in reps) / slots
      step_s = sum(rep["decoded"]["decode_s"] for rep in reps) / steps
      ways = g.axes.get("data", 1)  # data replicas inside one replica (the calibrate record's unit)
      out.append({
          "pool": "rollout",
          "device_type": g.device_type or mesh_file.platform,
          "devices": g.count * g.devices,
          "mesh": {
              "data": g.count * ways,
              "tensor": g.axes.get("tensor", 1)
          },
          "model": model,
          "batch": slots // ways,
          "context": context,
          "decode_tokens_per_s": slots * g.count / step_s,  # every slot of every replica, per step
          "run": workdir,
      })
      if cfg.train.max_staleness == 0 and len(routes) > 1:  # synchronous: a batch's time is its own
        out.append(_batch_record(routes[1:], gi, g, slots, r, prompt_len, rows, model, mesh_file, workdir))
  else:
    data = rollout.axes.get("data", 1) * rollout.axes.get("fsdp", 1)
    out.append({
        "pool": "rollout",
        "device_type": rollout.device_type or mesh_file.platform,
        "devices": len(rollout.device_ids),
        "mesh": {
            "data": data,
            "tensor": rollout.axes.get("tensor", 1)
        },
        "model": model,
        "batch": (r.slots or r.prompts_per_step * r.group_size) // data,
        "context": context,
        "decode_tokens_per_s": _median(rows, "rollout_tokens_per_s"),
        "run": workdir,
    })
  return out


def calibrate_runs(workdirs, held_out=(), measured=(), catalog_path=None, cluster_path=None) -> dict:
  """Fit on the records of `workdirs` (+ measured-record files), score `held_out` runs' records
  -> {overlay, fitted: [per-record errors], held_out: [per-record errors]}. The catalog is the
  built-in one, then the cluster file's own (its device types), then `catalog_path`."""
  catalog = (allocate.load_cluster(cluster_path, catalog_path).catalog if cluster_path else load_catalog(catalog_path))
  fit = [rec for w in workdirs for rec in run_records(w)] + cal.load_measurements(measured)
  scored = [rec for w in held_out for rec in run_records(w)]
  overlay, report = cal.calibrate(fit, catalog)
  for rec, row in zip(fit, report):
    row["run"] = rec.get("run")
  held = cal.error_report(scored, catalog, overlay) if scored else []
  for rec, row in zip(scored, held):
    row["run"] = rec["run"]
  return {"overlay": overlay, "fitted": report, "held_out": held}


def _print(title, rows):
  if not rows:
    return
  print(title)
  for r in rows:
    print(f"  {r['pool']:>7} {r['device_type']} x{r['devices']} {r['mesh']} ({r.get('run') or 'measured'}): "
          f"measured {r['measured_s'] * 1e3:.2f} ms, predicted {r['predicted_before_s'] * 1e3:.2f} -> "
          f"{r['predicted_after_s'] * 1e3:.2f} ms, error {r['error_before']:.0%} -> {r['error_after']:.0%}")


def _calibrate(args):
  try:
    result = calibrate_runs(args.workdirs, args.held_out, args.measured, args.catalog, args.cluster)
  except PlanError as e:
    raise UserError(f"calibrate: {e}") from None
  with open(args.out, "w") as f:
    f.write("# Written by `jaxrl-hex calibrate`: per device type, the factors fitted to the runs\n"
            f"# {', '.join(args.workdirs)}. Use it with `jaxrl-hex plan --catalog {args.out}`.\n")
    yaml.safe_dump(result["overlay"], f, sort_keys=False)
  _print("fitted on:", result["fitted"])
  _print("held out:", result["held_out"])
  if args.report:
    with open(args.report, "w") as f:
      json.dump(result, f, indent=2, default=str)
  print(f"calibrate: {args.out}")


def main(argv) -> int:
  ap = arguments.Parser("jaxrl-hex calibrate", "Fit the planner's cost model to runs on your cluster.")
  ap.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="train runs to fit on (metrics.jsonl, config.json)")
  ap.add_argument("--held-out", nargs="*", default=[], metavar="WORKDIR",
                  help="runs scored with the fitted factors, not fitted on (the error on an unseen workload)")
  ap.add_argument("--measured", nargs="*", default=[], metavar="FILE",
                  help="extra measured-record JSON files (planner/calibrate.py's format)")
  ap.add_argument("--catalog", help="a catalog overlay to start from (YAML, the catalog's shape)")
  ap.add_argument(
      "--cluster", help="the cluster file the runs' plan came from: its own catalog entries (and "
      "--catalog on top) are the starting point")
  ap.add_argument("--out", required=True, help="where to write the fitted catalog overlay (YAML)")
  ap.add_argument("--report", help="also write every record's error before and after as JSON here")
  return arguments.run(ap, _calibrate, argv)
