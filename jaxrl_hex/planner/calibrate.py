"""Calibration: fit each device type's efficiency factors to measured runs; report prediction error.

Measured-run JSON (one record, a list of records, or {"records": [...]} per file):

  {"pool": "train", "device_type": "cpu", "devices": 4, "mesh": {"fsdp": 2, "tensor": 2},
   "model": {...model_config fields...} or "tiny", "seq_len": 64, "tokens_per_step": 8192,
   "tokens_per_s": 51000.0}
  {"pool": "rollout", "device_type": "cpu", "devices": 4, "mesh": {"data": 2, "tensor": 2},
   "model": ..., "batch": 32, "context": 40, "decode_tokens_per_s": 30000.0}

  {"pool": "rollout_batch", "device_type": "cpu", "devices": 1, "mesh": {"data": 1, "tensor": 1},
   "model": ..., "sequences": 88, "group_size": 8, "prompt_len": 9, "output_mean": 3.6,
   "output_max": 6, "slots": 88, "seconds": 0.045}

`batch` is the sequences one replica decodes together, `context` their mean length during the
measurement; `decode_tokens_per_s` is summed over the pool's `data` replicas. A rollout_batch
record is one replica's part of a synchronous step (its `sequences` of a batch in `seconds`):
what the cost model's prefill and decode do not explain of it is the type's rollout_overhead_s,
fitted after its decode factors.

The cost model predicts time = sum of roofline parts / their efficiencies + comm + overhead
(train: one part; decode: weight matmuls and attention), linear in (1/efficiency..., overhead),
so all are fitted per device type and pool by non-negative least squares on relative error.
With too few distinct operating points only the first efficiency is fitted.
"""
import dataclasses
import json
import pathlib

import numpy as np
from scipy.optimize import nnls

from jaxrl_hex.models.config import model_config
from jaxrl_hex.planner import PlanError, cost_model as cm
from jaxrl_hex.planner.model_files import load_model

FIELDS = {
    "train": ("device_type", "devices", "mesh", "model", "seq_len", "tokens_per_step", "tokens_per_s"),
    "rollout": ("device_type", "devices", "mesh", "model", "batch", "context", "decode_tokens_per_s"),
    # a replica's part of a synchronous step: `sequences` of one batch (group_size per prompt) in
    # `seconds`, prefill, decode and whatever else the replica spends on a batch
    "rollout_batch": ("device_type", "devices", "mesh", "model", "sequences", "group_size", "prompt_len", "output_mean",
                      "output_max", "slots", "seconds"),
}
# (efficiency fields, one per roofline part of TimeParts, overhead field) in the catalog for each pool.
FACTORS = {
    "train": (("train_mfu",), "train_overhead_s"),
    "rollout": (("rollout_eff", "attention_eff"), "decode_overhead_s"),
    "rollout_batch": ((), "rollout_overhead_s"),  # after "rollout": the rest of a batch's time
}
PARTS = ("roofline_s", "attention_s")  # the roofline parts the efficiency fields divide, in order


def load_measurements(paths) -> list:
  records = []
  for path in paths:
    try:
      data = json.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
      raise PlanError(f"measurement file {path} not found") from None
    except json.JSONDecodeError as e:
      raise PlanError(f"measurement file {path} is not valid JSON ({e})") from None
    data = data.get("records", data) if isinstance(data, dict) else data
    for i, rec in enumerate(data if isinstance(data, list) else [data]):
      records.append(_check(rec, f"{path}[{i}]"))
  return records


def _check(rec, where):
  pool = rec.get("pool") if isinstance(rec, dict) else None
  if pool not in FIELDS:
    raise PlanError(f"{where}: 'pool' must be 'train' or 'rollout'")
  missing = [f for f in FIELDS[pool] if f not in rec]
  if missing:
    raise PlanError(f"{where}: {pool} record missing field(s) {missing}")
  return rec


def _model(spec):
  if isinstance(spec, str):
    return cm.ModelCost.from_config(load_model(spec)[1])
  return cm.ModelCost.from_config(model_config(**spec))


def predict(rec, dev):
  """(measured seconds, predicted TimeParts) of the record's step on catalog device `dev`."""
  m, mesh = _model(rec["model"]), rec["mesh"]
  if rec["pool"] == "train":
    remat = rec["model"].get("remat", "none") if isinstance(rec["model"], dict) else "none"
    layout = cm.TrainLayout(mesh.get("data", 1), mesh.get("fsdp", 1), mesh.get("tensor", 1), remat)
    if layout.devices != rec["devices"]:
      raise PlanError(f"train record on {rec['devices']} devices has mesh {mesh} of {layout.devices}")
    return (rec["tokens_per_step"] / rec["tokens_per_s"],
            cm.train_time(m, dev, layout, rec["tokens_per_step"], rec["seq_len"]))
  tensor, replicas = mesh.get("tensor", 1), mesh.get("data", 1)
  if tensor * replicas != rec["devices"]:
    raise PlanError(f"rollout record on {rec['devices']} devices has mesh {mesh} of {tensor * replicas}")
  if rec["pool"] == "rollout_batch":  # the planner's time for the replica's sequences (as comm_s) + the overhead
    w = cm.Workload(batch_size=1, group_size=rec["group_size"], prompt_len=rec["prompt_len"],
                    output_mean=rec["output_mean"], output_max=rec["output_max"], eta=0, max_concurrency=rec["slots"])
    r = cm.replica(m, dev, tensor, w)
    if r is None:
      raise PlanError(f"rollout_batch record: one sequence does not fit a {dev.name} replica at tensor {tensor}")
    a, b, c = r.load_coeffs(w)
    n = rec["sequences"]
    return rec["seconds"], cm.TimeParts(0.0, max(a + b * n, c * n), 1.0, dev.rollout_overhead_s)
  per_replica = rec["decode_tokens_per_s"] / replicas
  return rec["batch"] / per_replica, cm.decode_time(m, dev, tensor, rec["batch"], rec["context"])


def calibrate(records, catalog) -> tuple:
  """Fit factors; returns (catalog overlay {"devices": {type: {field: value}}}, per-record report)."""
  overlay = {}
  groups = {}
  for rec in records:
    if rec["device_type"] not in catalog:
      raise PlanError(f"measured record: unknown device_type '{rec['device_type']}'; add it to the catalog")
    groups.setdefault((rec["device_type"], rec["pool"]), []).append(rec)
  order = list(FACTORS)  # a batch record's model time uses its type's fitted decode factors
  for (kind, pool), recs in sorted(groups.items(), key=lambda kv: order.index(kv[0][1])):
    dev = dataclasses.replace(catalog[kind], **overlay.get(kind, {}))
    rows = [predict(r, dev) for r in recs]
    measured = np.array([t for t, _ in rows])
    eff_fields, over_field = FACTORS[pool]
    per_unit = np.array([predict(r, dataclasses.replace(dev, **{over_field: 1.0}))[1].overhead_s for r in recs])
    parts = np.array([[getattr(p, part) for part in PARTS[:len(eff_fields)]] for _, p in rows])  # [records, parts]
    comm = np.array([p.comm_s for _, p in rows])
    if not eff_fields:  # an overhead alone: what the model leaves of the measured time, on average
      effs, overhead = [], max(float(np.mean((measured - comm) / per_unit)), 0.0)
    else:
      effs, overhead = _fit(parts, per_unit, measured, (measured - comm) / measured,
                            [getattr(dev, f) for f in eff_fields], getattr(dev, over_field))
    overlay[kind] = dict(overlay.get(kind, {}), **dict(zip(eff_fields, effs)), **{over_field: overhead})
  return {"devices": overlay}, error_report(records, catalog, {"devices": overlay})


def _fit(parts, per_unit, measured, target, effs, overhead):
  """Least squares on relative error, non-negative: target = sum_i parts_i / (eff_i * measured)
  + overhead * per_unit / measured. A part the records cannot separate from the others (too few
  distinct operating points) or do not show (its 1/eff fits to 0) keeps its catalog factor;
  with one distinct point only the first efficiency is fitted, at the catalog's overhead, or,
  where that overhead alone exceeds the measured time, the overhead at the catalog's efficiency.
  -> (efficiencies, overhead)."""
  effs, free = list(effs), list(range(len(effs)))
  while free:
    known = sum(parts[:, i] / effs[i] for i in range(len(effs)) if i not in free) / measured
    if len({tuple(r) for r in np.round(parts[:, free], 15)}) > len(free):
      *inv, fitted_overhead = nnls(np.column_stack([parts[:, free] / measured[:, None], per_unit / measured]),
                                   target - known)[0]
    elif len(free) > 1:
      free.pop()
      continue
    else:
      fitted_overhead = overhead
      inv = [np.mean((target - known - overhead * per_unit / measured) * measured / parts[:, free[0]])]
    # the records show only overhead (or the catalog's overhead alone is more than was measured):
    # keep the efficiency, fit the overhead
    if len(free) == 1 and inv[0] <= 0:
      inv = [1 / effs[free[0]]]
      fitted_overhead = max(
          float(np.mean((target - known - parts[:, free[0]] * inv[0] / measured) * measured / per_unit)), 0.0)
    if all(v > 0 for v in inv):
      for i, v in zip(free, inv):
        effs[i] = float(1 / v)
      return effs, float(fitted_overhead)
    free = [i for i, v in zip(free, inv) if v > 0]
  return effs, float(overhead)


def error_report(records, catalog, overlay) -> list:
  """Per record: measured and predicted seconds on the catalog (before) and the catalog plus
  `overlay` (after), with relative errors. Records left out of the fit score held-out error."""
  report = []
  for rec in records:
    dev = catalog[rec["device_type"]]
    fitted = dataclasses.replace(dev, **overlay["devices"].get(rec["device_type"], {}))
    measured, before = predict(rec, dev)
    after = predict(rec, fitted)[1]
    report.append({
        "pool": rec["pool"],
        "device_type": rec["device_type"],
        "devices": rec["devices"],
        "mesh": rec["mesh"],
        "measured_s": measured,
        "predicted_before_s": before.total_s,
        "predicted_after_s": after.total_s,
        "error_before": abs(before.total_s - measured) / measured,
        "error_after": abs(after.total_s - measured) / measured
    })
  return report
