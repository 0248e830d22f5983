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
