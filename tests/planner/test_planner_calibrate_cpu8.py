"""benchmarks/calibrate_cpu8.py, reduced: its measured cpu-8 runs are valid records that calibrate."""
import dataclasses
import importlib.util
import json
import math
import os

import pytest
from support import ROOT

from jaxrl_hex.planner import calibrate as cal
from jaxrl_hex.planner.catalog import CATALOG_PATH, load_catalog


@pytest.fixture(scope="module")
def c8():
  spec = importlib.util.spec_from_file_location("calibrate_cpu8", os.path.join(ROOT, "benchmarks", "calibrate_cpu8.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_measured_runs_are_records_that_calibrate(c8, tmp_path):
  points = c8.build_points([("tiny", 16, 16, False), ("tiny", 32, 16, True)], [("tiny", 4, 16, False),
                                                                               ("tiny", 8, 32, True)])
  path = tmp_path / "measured.json"
  path.write_text(json.dumps({"records": c8.measure(points, rounds=2, warmup=1)}))
  records = cal.load_measurements([path])  # raises on a missing documented field
  assert [r["pool"] for r in records] == ["train", "train", "rollout", "rollout"]
  for r in records:
    assert set(cal.FIELDS[r["pool"]]) <= set(r) and r["device_type"] == "cpu" and r["devices"] == 4
    assert r["step_s"] > 0 and len(r["step_s_all"]) == 2 and all(t > 0 for t in r["step_s_all"])
    assert r["spread"] >= 0
  train, rollout = records[:2], records[2:]
  assert [r["mesh"] for r in train] == [{"fsdp": 2, "tensor": 2}] * 2
  assert [(r["seq_len"], r["tokens_per_step"]) for r in train] == [(16, 256), (16, 512)]
  assert [r["tokens_per_s"] * r["step_s"] for r in train] == pytest.approx([256, 512])
  assert [r["mesh"] for r in rollout] == [{"data": 2, "tensor": 2}] * 2
  # two replicas decode `batch` sequences each per step
  assert [r["decode_tokens_per_s"] * r["step_s"] for r in rollout] == pytest.approx([8, 16])

  # one fit point per pool fits the efficiency alone, keeping the catalog's overhead: with none
  # (the catalog's may exceed a step this small) the fit reproduces the point exactly
  catalog = load_catalog()
  catalog["cpu"] = dataclasses.replace(catalog["cpu"], train_overhead_s=0.0, decode_overhead_s=0.0)
  result = c8.fit(records, catalog)
  factors = result["overlay"]["devices"]["cpu"]
  assert set(factors) == set(c8.FIELDS)
  assert all(math.isfinite(v) and v >= 0 for v in factors.values())
  assert factors["train_mfu"] > 0 and factors["rollout_eff"] > 0
  assert [r["held_out"] for r in result["rows"]] == [False, True, False, True]
  assert set(result["error_after"]) == {"train_in_sample", "train_held_out", "rollout_in_sample", "rollout_held_out"}
  assert [r["error_after"] for r in result["rows"] if not r["held_out"]] == pytest.approx([0, 0], abs=1e-9)


def test_write_catalog_changes_only_the_cpu_factors(c8, tmp_path):
  path = tmp_path / "catalog.yaml"
  path.write_text(CATALOG_PATH.read_text())
  factors = {
      "train_mfu": 0.0123,
      "rollout_eff": 0.0456,
      "attention_eff": 0.0789,
      "train_overhead_s": 0.0021,
      "decode_overhead_s": 0.00031
  }
  for note in ("on day 1", "on day 2"):  # a rerun replaces its own lines
    c8.write_catalog(factors, note, path)
  old, new = CATALOG_PATH.read_text(), path.read_text()
  assert new.count("# fitted by benchmarks/calibrate_cpu8.py on day 2") == 1 and "day 1" not in new
  cpu = load_catalog(path)["cpu"]
  assert {f: getattr(cpu, f) for f in c8.FIELDS} == factors
  before, after = load_catalog(), load_catalog(path)
  assert {k: v for k, v in before.items() if k != "cpu"} == {k: v for k, v in after.items() if k != "cpu"}
  assert new[:new.index("\n  cpu:\n")] == old[:old.index("\n  cpu:\n")]
