"""Calibration: fitted factors bring predicted cpu-8 step times within 25% of measured."""
import dataclasses
import json

import numpy as np
import pytest

from jaxrl_hex.planner import PlanError, calibrate as cal, cost_model as cm
from jaxrl_hex.planner.catalog import load_catalog

TINY = dict(vocab_size=16, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=256,
            tie_embeddings=True)


def synthetic_runs(truth, noise=0.05, seed=0):
  """Measured-run JSON records for the cpu-8 layouts (train fsdp2 x tensor2, rollout data2 x tensor2)."""
  m = cm.ModelCost.from_config(cal.model_config(**TINY))
  rng = np.random.default_rng(seed)
  out = []
  for tokens in (2048, 8192, 32768):
    step = cm.train_time(m, truth, cm.TrainLayout(1, 2, 2), tokens, 64).total_s * rng.uniform(1 - noise, 1 + noise)
    out.append({
        "pool": "train",
        "device_type": "cpu",
        "devices": 4,
        "mesh": {
            "fsdp": 2,
            "tensor": 2
        },
        "model": TINY,
        "seq_len": 64,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step
    })
  for batch, context in ((8, 40), (32, 40), (128, 40), (32, 400)):
    step = cm.decode_time(m, truth, 2, batch, context).total_s * rng.uniform(1 - noise, 1 + noise)
    out.append({
        "pool": "rollout",
        "device_type": "cpu",
        "devices": 4,
        "mesh": {
            "data": 2,
            "tensor": 2
        },
        "model": TINY,
        "batch": batch,
        "context": context,
        "decode_tokens_per_s": 2 * batch / step
    })
  return out


def test_calibration_fits_cpu8_within_25_percent(tmp_path):
  cat = load_catalog()
  truth = dataclasses.replace(cat["cpu"], train_mfu=0.23, train_overhead_s=0.004, rollout_eff=0.05, attention_eff=0.02,
                              decode_overhead_s=0.0004)
  path = tmp_path / "measured.json"
  path.write_text(json.dumps({"records": synthetic_runs(truth)}))
  overlay, report = cal.calibrate(cal.load_measurements([path]), cat)
  assert max(r["error_before"] for r in report) > 0.25  # the uncalibrated catalog is off
  assert max(r["error_after"] for r in report) < 0.10  # well inside the 25% target
  fitted = overlay["devices"]["cpu"]
  assert fitted["train_mfu"] == pytest.approx(0.23, rel=0.2)
  assert fitted["rollout_eff"] == pytest.approx(0.05, rel=0.2)
  assert fitted["attention_eff"] == pytest.approx(0.02, rel=0.2)
  # The overlay is a catalog file: planning with it reproduces the calibrated predictions.
  extra = tmp_path / "cpu-calibrated.yaml"
  extra.write_text(json.dumps(overlay))
  assert load_catalog(extra)["cpu"].train_mfu == pytest.approx(fitted["train_mfu"])


def test_single_operating_point_fits_efficiency_only():
  cat = load_catalog()
  truth = dataclasses.replace(cat["cpu"], train_mfu=0.3)
  overlay, report = cal.calibrate(synthetic_runs(truth, noise=0)[:1], cat)
  assert overlay["devices"]["cpu"]["train_mfu"] == pytest.approx(0.3, rel=1e-6)
  assert report[0]["error_after"] < 1e-6


def test_batch_records_fit_the_rollout_overhead_after_the_decode_factors():
  """A synchronous batch's time beyond the cost model's prefill and decode is the type's
  rollout_overhead_s; it is fitted on the decode factors the same call fits, so records given in
  any order recover it, and the fitted replica's batch time is the measured one."""
  cat = load_catalog()
  truth = dataclasses.replace(cat["cpu"], rollout_eff=0.05, attention_eff=0.02, decode_overhead_s=0.0004,
                              rollout_overhead_s=0.02)
  m = cm.ModelCost.from_config(cal.model_config(**TINY))
  batches = []
  for sequences, group in ((64, 2), (128, 4), (256, 8)):
    w = cm.Workload(batch_size=1, group_size=group, prompt_len=8, output_mean=4.0, output_max=6, eta=0,
                    max_concurrency=sequences)
    r = cm.replica(m, truth, 1, w)
    a, b, c = r.load_coeffs(w)
    batches.append({
        "pool": "rollout_batch",
        "device_type": "cpu",
        "devices": 1,
        "mesh": {
            "data": 1,
            "tensor": 1
        },
        "model": TINY,
        "sequences": sequences,
        "group_size": group,
        "prompt_len": 8,
        "output_mean": 4.0,
        "output_max": 6,
        "slots": sequences,
        "seconds": 0.02 + max(a + b * sequences, c * sequences)
    })
  decode = [r for r in synthetic_runs(truth, noise=0) if r["pool"] == "rollout"]
  overlay, report = cal.calibrate(batches + decode, cat)  # batch records first: still fitted after decode
  assert overlay["devices"]["cpu"]["rollout_overhead_s"] == pytest.approx(0.02, rel=1e-3)
  assert max(r["error_after"] for r in report) < 1e-3
  assert cat["cpu"].rollout_overhead_s == 0.0 and min(r["error_before"] for r in report[:3]) > 0.1


def test_bad_measurement_records(tmp_path):
  path = tmp_path / "m.json"
  path.write_text(json.dumps([{"pool": "train", "device_type": "cpu"}]))
  with pytest.raises(PlanError, match="train record missing field"):
    cal.load_measurements([path])
  path.write_text(json.dumps({"pool": "eval"}))
  with pytest.raises(PlanError, match="'pool' must be"):
    cal.load_measurements([path])
