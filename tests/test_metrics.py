"""Run records as a person reads them: TensorBoard files that TensorBoard itself reads back, and
progress lines that stay plain text when the output is not a terminal."""
import io
import os
import sys

import pytest
from support import load_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxrl_hex.errors import UserError
from jaxrl_hex.metrics import TB_DIR, Progress, Recorder, read_jsonl, tb_values


def _read_tb(workdir):
  """{tag: {step: value}} and {tag: {step: (bucket_limits, counts)}} through TensorBoard's own reader."""
  acc = EventAccumulator(os.path.join(workdir, TB_DIR), size_guidance={"scalars": 0, "histograms": 0})
  acc.Reload()
  scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
  hists = {
      t: {
          e.step: (list(e.histogram_value.bucket_limit), list(e.histogram_value.bucket)) for e in acc.Histograms(t)
      } for t in acc.Tags()["histograms"]
  }
  return scalars, hists


def _assert_tb_holds_every_metric(workdir):
  scalars, hists = _read_tb(workdir)
  rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  n = 0
  for row in rows:
    want_scalars, want_hists = tb_values(row)
    for tag, value in want_scalars.items():
      assert scalars[tag][row["step"]] == pytest.approx(value, rel=1e-6), tag
      n += 1
    for tag, counts in want_hists.items():
      assert hists[tag][row["step"]] == ([v + 0.5 for v in sorted(counts)], [counts[v] for v in sorted(counts)])
      n += 1
  return n


def test_tensorboard_holds_every_metric_of_a_real_sft_run(warm_workdir):
  scalars, _ = _read_tb(warm_workdir)
  assert {"sft/loss", "sft/eval_accuracy", "sft/train_tokens_per_s", "sft/wall_s"} <= set(scalars)
  assert _assert_tb_holds_every_metric(warm_workdir) > 100


def test_tensorboard_rows_with_staleness_histograms(tmp_path):
  rec = Recorder(str(tmp_path))
  rec.log({"phase": "train", "step": 0, "eval_accuracy": 0.5, "policy_version": 0, "wall_s": 1.0})
  rec.log({
      "phase": "train",
      "step": 1,
      "reward_mean": 0.25,
      "staleness_mean": 0.75,
      "staleness_max": 1,
      "staleness_hist": {
          "0": 8,
          "1": 24
      },
      "policy_version": 1,
      "wall_s": 2.5
  })
  rec.log({
      "phase": "train",
      "step": 2,
      "reward_mean": 0.5,
      "staleness_hist": {
          "1": 16,
          "2": 16
      },
      "note": "text is not a metric",
      "wall_s": 3.0
  })
  rec.close()
  scalars, hists = _read_tb(str(tmp_path))
  assert scalars["train/reward_mean"] == {1: 0.25, 2: 0.5}
  assert scalars["train/eval_accuracy"] == {0: 0.5}
  assert hists["train/staleness_hist"] == {1: ([0.5, 1.5], [8, 24]), 2: ([1.5, 2.5], [16, 16])}
  assert not any("note" in t for t in scalars)
  assert _assert_tb_holds_every_metric(str(tmp_path)) == 12


def test_tensorboard_can_be_switched_off(tmp_path):
  rec = Recorder(str(tmp_path), config=load_config(**{"log.tensorboard": False}))
  rec.log({"phase": "train", "step": 1, "reward_mean": 0.5})
  rec.close()
  assert not os.path.exists(tmp_path / TB_DIR) and read_jsonl(tmp_path / "metrics.jsonl")[0]["reward_mean"] == 0.5


def test_wandb_asked_for_but_not_installed(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if it were absent
  with pytest.raises(UserError, match="log.wandb_project is set but wandb is not installed"):
    Recorder(str(tmp_path), config=load_config(**{"log.wandb_project": "demo"}))


def test_wandb_run_gets_every_metric_offline(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  rec = Recorder(str(tmp_path), config=load_config(**{"log.wandb_project": "demo"}))
  for step in (1, 2, 3):
    rec.log({"phase": "train", "step": step, "reward_mean": step / 10, "wall_s": float(step)})
  summary = dict(rec._wandb.summary)  # the run's last values, as W&B will sync them
  rec.close()
  assert summary["train/reward_mean"] == pytest.approx(0.3) and summary["train/step"] == 3
  runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
  assert len(runs) == 1 and any(f.endswith(".wandb") for f in os.listdir(tmp_path / "wandb" / runs[0]))


class _Terminal(io.StringIO):

  def isatty(self):
    return True


def _rows():
  for step in range(1, 21):
    row = {
        "step": step,
        "reward_mean": 0.5 + step / 100,
        "staleness_mean": 1.5,
        "staleness_max": 2,
        "rollout_tokens_per_s": 35123.0,
        "train_tokens_per_s": 1.25e6,
        "sync_seconds": 0.0042
    }
    if step % 8 == 0:
      row["eval_accuracy"] = step / 40
    yield step, row


def test_progress_in_a_log_is_plain_lines(monkeypatch):
  monkeypatch.delenv("JAXRL_HEX_QUIET", raising=False)
  out = io.StringIO()
  progress = Progress("train", 20, every=5, stream=out)
  for step, row in _rows():
    progress.update(step, row)
  progress.close("train: done")
  lines = out.getvalue().splitlines()
  assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()
  # every 5 steps, plus each evaluation (8, 16), plus the closing summary
  assert [l.split()[1] for l in lines[:-1]] == ["5/20", "8/20", "10/20", "15/20", "16/20", "20/20"]
  assert lines[-1] == "train: done"
  last = lines[-2]
  for part in ("100%", "eta 0s", "reward 0.700", "eval acc 0.400 (best 0.400)", "staleness 1.50 (max 2)",
               "rollout tok/s 35.1k", "train tok/s 1.25M", "sync 4.2ms", "step/s"):
    assert part in last, (part, last)


def test_progress_on_a_terminal_redraws_a_panel(monkeypatch):
  monkeypatch.delenv("JAXRL_HEX_QUIET", raising=False)
  out = _Terminal()
  progress = Progress("sft", 20, every=5, stream=out)
  for step, row in _rows():
    progress.update(step, row)
  progress.close()
  text = out.getvalue()
  assert "\x1b[" in text  # a live display: cursor movement and colour
  for part in ("20/20", "reward", "0.700", "eval acc", "35.1k", "1.25M", "4.2ms"):
    assert part in text, part


def test_quiet_progress_prints_nothing(monkeypatch):
  monkeypatch.setenv("JAXRL_HEX_QUIET", "1")
  out = _Terminal()
  progress = Progress("train", 20, stream=out)
  for step, row in _rows():
    progress.update(step, row)
  progress.close("summary")
  assert out.getvalue() == "" and progress.last["step"] == 20 and progress.best_eval == 0.4


def test_progress_toward_an_accuracy_target_claims_no_eta_to_the_step_cap(monkeypatch):
  """The warm start stops at sft.target_accuracy, long before sft.max_steps: the line says the
  step count is a cap, gives no percentage of it, and the time to it as an upper bound only."""
  monkeypatch.delenv("JAXRL_HEX_QUIET", raising=False)
  out = io.StringIO()
  progress = Progress("warmstart", 3000, every=5, stream=out, target=("eval_accuracy", 0.4))
  for step, row in _rows():
    progress.update(step, row)
  progress.close()
  last = out.getvalue().splitlines()[-1]
  assert last.startswith("warmstart 20 (up to 3000, stops at eval acc 0.400) elapsed "), last
  assert "eta <= " in last and "%" not in last and "3000/" not in last and "20/3000" not in last
  assert Progress("train", 20, stream=io.StringIO()).eta() == "?"  # no rate yet, no claim


def test_progress_panel_toward_a_target_shows_the_target(monkeypatch):
  monkeypatch.delenv("JAXRL_HEX_QUIET", raising=False)
  out = _Terminal()
  progress = Progress("warmstart", 3000, every=5, stream=out, target=("eval_accuracy", 0.4))
  for step, row in _rows():
    progress.update(step, row)
  progress.close()
  text = out.getvalue()
  assert "up to 3000" in text and "stops at eval acc 0.400" in text and "20/3000" not in text


@pytest.mark.slow  # ~35 s on 2 cores: the trainer's and the engine's compiles
def test_sft_console_names_its_accuracy_target(tmp_path, capsys, monkeypatch):
  """A real SFT run's progress lines (2 steps)."""
  from support import SMALL, load_config

  from jaxrl_hex import commands
  monkeypatch.delenv("JAXRL_HEX_QUIET", raising=False)
  cfg = load_config(**SMALL, **{"sft.max_steps": 2, "sft.eval_every": 2, "sft.target_accuracy": 0.9})
  summary = commands.sft(cfg, str(tmp_path / "sft"))
  lines = capsys.readouterr().out.splitlines()
  assert any(line.startswith("sft 2 (up to 2, stops at eval acc 0.900)") for line in lines), lines
  assert summary["steps"] == 2


def test_faults_show_in_the_progress_line_when_they_happen(monkeypatch):
  """Reward errors, replica restarts and skipped updates get a line at once (not at the next
  `every`) and stay in every line after it."""
  monkeypatch.delenv("JAXRL_HEX_QUIET", raising=False)
  out = io.StringIO()
  progress = Progress("train", 100, every=50, stream=out)
  rows = [{
      "reward_errors": 0
  }, {
      "reward_errors": 3
  }, {
      "reward_errors": 3,
      "nonfinite_updates": 1
  }, {
      "reward_errors": 3,
      "nonfinite_updates": 0
  }, {
      "reward_errors": 3,
      "rollout_restarts": 1
  }]
  for step, row in enumerate(rows, 1):
    progress.update(step, row)
  lines = out.getvalue().splitlines()
  assert [line.split()[1] for line in lines] == ["2/100", "3/100", "5/100"]  # steps 1 and 4 brought no new fault
  assert lines[0].endswith("| reward errors 3")
  assert lines[1].endswith("| reward errors 3 | skipped updates 1")
  assert lines[2].endswith("| reward errors 3 | replica restarts 1 | skipped updates 1")
