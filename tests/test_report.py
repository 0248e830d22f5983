"""`jaxrl-hex report` on a real short run, resumed half-way (conftest's resumed_run, which test_cli's resume
test shares): every figure drawn with content, the markdown lists them, curves break at the resume, the
timeline's overview is to scale."""
import json
import os

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.image import imread
from support import RESUMED_AT, RESUMED_STEPS
from test_metrics import _assert_tb_holds_every_metric

from jaxrl_hex import cli, report
from jaxrl_hex.metrics import read_jsonl
from jaxrl_hex.report import FIGURES


@pytest.fixture
def drawn():
  """figures(workdir) -> {name: figure} of a one-run report, closed after the test."""
  opened = []

  def draw(workdir, label):
    figs = report.figures([report.load_run(workdir, label)])
    opened.extend(figs.values())
    return figs

  yield draw
  for fig in opened:
    plt.close(fig)


def _curves(ax):
  """The data lines of an axis (the resume marks are unlabelled)."""
  return [line for line in ax.lines if not line.get_label().startswith("_")]


def _marks(ax):
  return [line.get_xdata()[0] for line in ax.lines if line.get_label().startswith("_") and line.get_linestyle() == "--"]


def _check_figure(path):
  assert os.path.getsize(path) > 15_000, path
  image = imread(path)  # (height, width, channels) floats
  height, width = image.shape[:2]
  assert width >= 700 and height >= 300, (path, image.shape)
  colours = np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
  assert len(colours) > 50, f"{path} is nearly blank"


def test_report_of_a_short_run(resumed_run, capsys):
  assert cli.main(["report", resumed_run]) == 0
  out = os.path.join(resumed_run, "report")
  assert capsys.readouterr().out.strip() == f"report: {os.path.join(out, 'report.md')}"
  rl_figures = [name for name in FIGURES if name not in ("sft_loss.png", "episodes.png")]  # no SFT, no episodes
  assert sorted(os.listdir(out)) == sorted(rl_figures + ["report.md", "report.json"])
  for name in rl_figures:
    _check_figure(os.path.join(out, name))
  md = open(os.path.join(out, "report.md")).read()
  for name in rl_figures:
    assert f"]({name})" in md
  assert f"| resumed | {RESUMED_STEPS} RL |" in md and f"- resumed: resumed at step {RESUMED_AT}." in md
  summary = json.load(open(os.path.join(out, "report.json")))["resumed"]
  assert summary["resumed_at"] == [RESUMED_AT]
  rows = [json.loads(l) for l in open(os.path.join(resumed_run, "metrics.jsonl"))]
  train = [r for r in rows if r["phase"] == "train"]
  assert summary["steps"] == RESUMED_STEPS and summary["staleness_max"] == max(r["staleness_max"] for r in train[1:])
  assert summary["eval_accuracy_end"] == train[-1]["eval_accuracy"]
  assert summary["staleness_mean"] == pytest.approx(np.mean([r["staleness_mean"] for r in train[1:]
                                                            ]))  # every step trains the same number of samples
  assert set(summary["busy"]) == {"rollout", "train"} and all(0 < v <= 1 for v in summary["busy"].values())


def test_curves_of_a_resumed_run_break_at_the_resume_and_mark_it(resumed_run, drawn):
  rows = [r for r in read_jsonl(os.path.join(resumed_run, "metrics.jsonl")) if r["phase"] == "train"]
  assert [r["step"] for r in rows] == list(range(RESUMED_STEPS + 1))
  assert rows[RESUMED_AT + 1]["resumed_from"] == RESUMED_AT
  run = report.load_run(resumed_run, "resumed")
  # the resumed process's seconds count on from the row it resumed at: its restart shows, the downtime does not
  restart = run.rows[RESUMED_AT + 1]["rl_s"] - run.rows[RESUMED_AT]["rl_s"]
  assert restart == pytest.approx(rows[RESUMED_AT + 1]["wall_s"]) and restart > 0
  figs = drawn(resumed_run, "resumed")
  panels = [*figs["reward.png"].axes, *figs["eval_accuracy.png"].axes, *figs["throughput.png"].axes]
  assert len(panels) == 6
  for ax in panels:
    wall = ax.get_xlabel().startswith("seconds")
    assert ax.get_xlabel() in ("RL step", "seconds since RL start"), ax.get_xlabel()
    at = run.rows[RESUMED_AT]["rl_s"] if wall else RESUMED_AT
    assert _marks(ax) == [pytest.approx(at)], ax.get_xlabel()
    assert [t.get_text() for t in ax.texts] == ["resumed"]
    for line in _curves(ax):
      x = np.asarray(line.get_xdata(), dtype=float)
      gap = np.flatnonzero(np.isnan(x))
      assert len(gap) == 1, (ax.get_ylabel(), line.get_label())  # one break, between the rows either side
      assert x[gap[0] - 1] <= at < x[gap[0] + 1] and np.isnan(line.get_ydata()[gap[0]])
      assert not np.isnan(np.delete(x, gap)).any()
  # held-out accuracy: evaluated at 0 and 3 by the first process, 4 and 6 by the resumed one
  step_line, = _curves(figs["eval_accuracy.png"].axes[0])
  assert np.array_equal(step_line.get_xdata(), [0, 3, np.nan, 4, 6], equal_nan=True)
  assert list(step_line.get_ydata()[[0, 1, 3,
                                     4]]) == [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]


def test_timeline_overview_draws_spans_to_scale(resumed_run, drawn):
  """The overview's bars are as long as their spans (a 5 ms sync stays 5 ms wide, drawn over the
  steps, never under them); the close-up widens short spans to be seen."""
  spans = read_jsonl(os.path.join(resumed_run, "spans.jsonl"))
  whole, zoom = drawn(resumed_run, "resumed")["timeline.png"].axes
  assert whole.get_title(loc="left") == "resumed: the whole run, to scale"

  def widths(ax):  # each bar: 4 corners from its start, the first again, a close code
    return {p.get_label(): np.ptp(p.get_path().vertices.reshape(-1, 6, 2)[:, :4, 0], axis=1) for p in ax.patches}

  want = {}
  for s in spans:
    want.setdefault(f"{s['pool']} {s['kind']}", []).append(s["end"] - s["start"])
  assert {"train step", "train sync", "rollout generate", "rollout reward"} <= set(want)
  got = widths(whole)
  assert set(got) == set(want)
  for label, durations in want.items():
    np.testing.assert_allclose(got[label], durations, rtol=1e-9, atol=1e-9, err_msg=label)
  order = [p.get_label() for p in whole.patches]
  assert order.index("train sync") > order.index("train step")  # short on top
  lo, hi = zoom.get_xlim()
  least = (hi - lo) * report.ZOOM_MIN_WIDTH
  for label, w in widths(zoom).items():
    np.testing.assert_allclose(w, np.maximum(want[label], least), rtol=1e-9, err_msg=label)
  assert min(want["train sync"]) < least  # the close-up did widen some


def test_an_sft_run_gets_its_own_figures_and_labels(warm_workdir, drawn, tmp_path):
  out = report.render([warm_workdir], str(tmp_path / "sft"))
  assert [os.path.basename(f) for f in out["figures"]] == ["sft_loss.png", "eval_accuracy.png", "throughput.png"]
  for path in out["figures"]:
    _check_figure(path)
  assert "| warm | " in open(out["markdown"]).read() and " SFT | " in open(out["markdown"]).read()
  figs = drawn(warm_workdir, "warm")
  assert list(figs) == ["sft_loss.png", "eval_accuracy.png", "throughput.png"]
  axes = [ax for fig in figs.values() for ax in fig.axes]
  assert len(figs["throughput.png"].axes) == 1  # no empty weight-sync panel
  assert {ax.get_xlabel() for ax in axes} == {"SFT step", "seconds since SFT start"}
  assert not any("RL" in text for fig in figs.values() for text in [fig.get_suptitle()] +
                 [t for ax in fig.axes for t in (ax.get_xlabel(), ax.get_ylabel(), ax.get_title())])
  rows = read_jsonl(os.path.join(warm_workdir, "metrics.jsonl"))
  loss, accuracy = figs["sft_loss.png"].axes
  assert "SFT loss" in loss.get_ylabel() and "token accuracy" in accuracy.get_ylabel()
  for ax, key in ((loss, "loss"), (accuracy, "token_accuracy")):
    line, = _curves(ax)
    assert list(line.get_xdata()) == [r["step"] for r in rows if key in r]
    assert list(line.get_ydata()) == [r[key] for r in rows if key in r]
  line, = _curves(figs["eval_accuracy.png"].axes[0])
  assert list(line.get_ydata()) == [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]


def test_tensorboard_of_a_short_run_holds_metrics_jsonl(resumed_run):
  assert _assert_tb_holds_every_metric(resumed_run) > RESUMED_STEPS * 10


def test_compare_two_runs_in_one_report(resumed_run, warm_workdir, tmp_path):
  out = str(tmp_path / "cmp")
  assert cli.main(["report", resumed_run, warm_workdir, f"--out={out}"]) == 0
  for name in FIGURES:
    if name != "episodes.png":  # neither run is an environment's
      _check_figure(os.path.join(out, name))
  md = open(os.path.join(out, "report.md")).read()
  labels = [os.path.basename(resumed_run), os.path.basename(warm_workdir)]
  assert all(f"| {label} |" in md for label in labels)


def test_report_of_a_directory_without_a_run(capsys, tmp_path):
  assert cli.main(["report", str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip()
  assert err == f"jaxrl-hex: error: report: {tmp_path} has no metrics.jsonl; pass the workdir of a train or sft run"


def test_plan_vs_measured_reads_the_plan_of_the_run_mesh_file(resumed_run, tmp_path):
  """A run whose mesh file carries a planner's `plan:` block: the report puts each predicted
  figure beside the run's own measure of it."""
  import shutil

  import yaml

  from jaxrl_hex.config import read_run_config, write_run_config
  workdir = tmp_path / "planned"
  shutil.copytree(resumed_run, workdir, ignore=shutil.ignore_patterns("checkpoints", "report", "tb"))
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
  gaps = [b["wall_s"] - a["wall_s"] for a, b in zip(rows, rows[1:]) if "resumed_from" not in b]  # one process's
  assert len(gaps) == len(rows) - 2 and plan["step_s"] == [0.5, pytest.approx(np.median(gaps))]
  assert plan["train_step_s"] == [0.25, pytest.approx(np.median(steps))]
  gens = {s["batch"]: s for s in spans if s["pool"] == "rollout" and s["kind"] == "generate"}
  assert plan["rollout_s"][1] == pytest.approx(np.median([s["end"] - s["start"] for s in gens.values()]))
  assert 0 < plan["gen_tokens_per_s"][1] < 1e6
  md = open(workdir / "report" / "report.md").read()
  assert "## Plan vs measured: planned" in md
  assert f"| step_s | 0.5 | {plan['step_s'][1]:,.4g} | {plan['step_s'][1] / 0.5:.2f}x |" in md


def test_curves_of_two_points_are_drawn(tmp_path):
  """A run that evaluated twice (at the start and the end) or took two steps: two-point curves."""
  rows = [{
      "phase": "train",
      "step": s,
      "wall_s": 1.0 + s,
      "reward_mean": 0.1 * s,
      "eval_accuracy": 0.5
  } for s in (0, 2)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "report"
  report.render([str(tmp_path)], str(out))
  assert (out / "reward.png").stat().st_size > 10_000 and (out / "eval_accuracy.png").exists()
