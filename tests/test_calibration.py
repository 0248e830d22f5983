"""`jaxrl-hex calibrate`: calibration records from real runs, fitted and scored on a held-out one."""
import json

import numpy as np
import pytest
import yaml
from support import SMALL, load_config

from jaxrl_hex import cli, commands
from jaxrl_hex.calibration import run_records
from jaxrl_hex.metrics import read_jsonl
from jaxrl_hex.planner.catalog import load_catalog


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_workdir):
  """Two short runs of different workloads on meshes/cpu-8.yaml."""
  out = {}
  for name, extra in (("a", {}), ("b", {"rollout.prompts_per_step": 4, "rollout.group_size": 8})):
    workdir = str(tmp_path_factory.mktemp("calibrate") / name)
    commands.train(load_config(**{**SMALL, **extra, "init_from": warm_workdir, "train.steps": 5}), workdir)
    out[name] = workdir
  return out


def test_a_run_gives_a_train_and_a_rollout_record_of_what_it_measured(runs):
  train, rollout = run_records(runs["a"])
  rows = [r for r in read_jsonl(f"{runs['a']}/metrics.jsonl") if r.get("phase") == "train" and "batch" in r][1:]
  assert (train["pool"], train["device_type"], train["devices"], train["mesh"]) == ("train", "cpu", 4, {
      "fsdp": 2,
      "tensor": 2
  })
  assert train["tokens_per_s"] == pytest.approx(np.median([r["train_tokens_per_s"] for r in rows]))
  assert train["tokens_per_step"] == round(np.median([r["train_tokens_per_s"] * r["train_seconds"] for r in rows]))
  assert train["model"]["d_model"] == load_config().model.d_model
  assert (rollout["mesh"], rollout["batch"]) == ({"data": 2, "tensor": 2}, 8 * 4 // 2)  # slots per data replica
  assert rollout["decode_tokens_per_s"] == pytest.approx(np.median([r["rollout_tokens_per_s"] for r in rows]))
  assert rollout["context"] > np.median([r["response_length_mean"] for r in rows]) / 2


def test_calibrate_fits_on_runs_and_scores_a_held_out_workload(runs, tmp_path, capsys):
  out, report = tmp_path / "fitted.yaml", tmp_path / "report.json"
  assert cli.main(["calibrate", runs["a"], "--held-out", runs["b"], f"--out={out}", f"--report={report}"]) == 0
  printed = capsys.readouterr().out
  assert "fitted on:" in printed and "held out:" in printed and printed.strip().endswith(f"calibrate: {out}")
  overlay = yaml.safe_load(out.read_text())
  assert set(overlay["devices"]) == {"cpu"}
  assert {"train_mfu", "train_overhead_s", "rollout_eff", "decode_overhead_s"} <= set(overlay["devices"]["cpu"])
  fitted = load_catalog(str(out))["cpu"]  # the overlay feeds `jaxrl-hex plan --catalog`
  assert fitted.train_overhead_s == pytest.approx(overlay["devices"]["cpu"]["train_overhead_s"])
  result = json.loads(report.read_text())
  assert [r["run"] for r in result["fitted"]] == [runs["a"]] * 2
  assert [r["run"] for r in result["held_out"]] == [runs["b"]] * 2
  for r in result["fitted"]:  # the fit explains the runs it saw far better than the catalog did
    assert r["error_after"] <= min(r["error_before"], 0.05) + 1e-6


def test_a_directory_without_a_run_is_one_line(tmp_path, capsys):
  assert cli.main(["calibrate", str(tmp_path), f"--out={tmp_path / 'x.yaml'}"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "has no metrics.jsonl and config.json" in err
