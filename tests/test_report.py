"""`jaxrl-hex report` on a real short run: every figure drawn with content, the markdown lists them."""
import json
import os

import numpy as np
import pytest
from matplotlib.image import imread
from support import SMALL, load_config
from test_metrics import _assert_tb_holds_every_metric

from jaxrl_hex import cli, commands
from jaxrl_hex.report import FIGURES


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, warm_workdir):
  workdir = str(tmp_path_factory.mktemp("report") / "async")
  commands.train(load_config(**SMALL, **{"init_from": warm_workdir, "train.steps": 6}), workdir)
  return workdir


def _check_figure(path):
  assert os.path.getsize(path) > 15_000, path
  image = imread(path)  # (height, width, channels) floats
  height, width = image.shape[:2]
  assert width >= 700 and height >= 300, (path, image.shape)
  colours = np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
  assert len(colours) > 50, f"{path} is nearly blank"


def test_report_of_a_short_run(short_run, capsys):
  assert cli.main(["report", short_run]) == 0
  out = os.path.join(short_run, "report")
  assert capsys.readouterr().out.strip() == f"report: {os.path.join(out, 'report.md')}"
  for name in FIGURES:
    _check_figure(os.path.join(out, name))
  md = open(os.path.join(out, "report.md")).read()
  for name in FIGURES:
    assert f"]({name})" in md
  assert "| async | 6 |" in md
  summary = json.load(open(os.path.join(out, "report.json")))["async"]
  rows = [json.loads(l) for l in open(os.path.join(short_run, "metrics.jsonl"))]
  train = [r for r in rows if r["phase"] == "train"]
  assert summary["steps"] == 6 and summary["staleness_max"] == max(r["staleness_max"] for r in train[1:])
  assert summary["eval_accuracy_end"] == train[-1]["eval_accuracy"]
  assert summary["staleness_mean"] == pytest.approx(np.mean([r["staleness_mean"] for r in train[1:]
                                                            ]))  # every step trains the same number of samples
  assert set(summary["busy"]) == {"rollout", "train"} and all(0 < v <= 1 for v in summary["busy"].values())


def test_tensorboard_of_a_short_run_holds_metrics_jsonl(short_run):
  assert _assert_tb_holds_every_metric(short_run) > 6 * 10


def test_compare_two_runs_in_one_report(short_run, warm_workdir, tmp_path):
  out = str(tmp_path / "cmp")
  assert cli.main(["report", short_run, warm_workdir, f"--out={out}"]) == 0
  for name in FIGURES:
    _check_figure(os.path.join(out, name))
  md = open(os.path.join(out, "report.md")).read()
  labels = [os.path.basename(short_run), os.path.basename(warm_workdir)]
  assert all(f"| {label} |" in md for label in labels)


def test_report_of_a_directory_without_a_run(capsys, tmp_path):
  assert cli.main(["report", str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip()
  assert err == f"jaxrl-hex: error: report: {tmp_path} has no metrics.jsonl; pass the workdir of a train or sft run"


def test_plan_vs_measured_reads_the_plan_of_the_run_mesh_file(short_run, tmp_path):
  """A run whose mesh file carries a planner's `plan:` block: the report puts each predicted
  figure beside the run's own measure of it."""
  import shutil

  import yaml

  from jaxrl_hex.config import read_run_config, write_run_config
  from jaxrl_hex.metrics import read_jsonl
  workdir = tmp_path / "planned"
  shutil.copytree(short_run, workdir, ignore=shutil.ignore_patterns("checkpoints", "report", "tb"))
  cfg = read_run_config(str(workdir))
  mesh = yaml.safe_load(open(cfg.mesh_file))
  mesh["plan"] = {"predicted": {"step_s": 0.5, "train_step_s": 0.25, "rollout_s": 0.4, "gen_tokens_per_s": 1000.0}}
  (workdir / "mesh.yaml").write_text(yaml.safe_dump(mesh))
  with cfg.unlocked():
    cfg.mesh_file = str(workdir / "mesh.yaml")
  write_run_config(cfg, str(workdir))
  assert cli.main(["report", str(workdir)]) == 0
  plan = json.load(open(workdir / "report" / "report.json"))["planned"]["plan"]
  rows = [r for r in read_jsonl(workdir / "metrics.jsonl") if r.get("phase") == "train" and "batch" in r]
  spans = read_jsonl(workdir / "spans.jsonl")
  steps = [s["end"] - s["start"] for s in spans if s["pool"] == "train" and s["kind"] == "step"]
  assert plan["step_s"] == [0.5, pytest.approx(np.median(np.diff([r["wall_s"] for r in rows])))]
  assert plan["train_step_s"] == [0.25, pytest.approx(np.median(steps))]
  gens = {s["batch"]: s for s in spans if s["pool"] == "rollout" and s["kind"] == "generate"}
  assert plan["rollout_s"][1] == pytest.approx(np.median([s["end"] - s["start"] for s in gens.values()]))
  assert 0 < plan["gen_tokens_per_s"][1] < 1e6
  md = open(workdir / "report" / "report.md").read()
  assert "## Plan vs measured: planned" in md
  assert f"| step_s | 0.5 | {plan['step_s'][1]:,.4g} | {plan['step_s'][1] / 0.5:.2f}x |" in md
