"""The command line as a user meets it: one-line errors for bad input, user tasks, resume."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from support import RESUMED_AT, RESUMED_STEPS, ROOT, SMALL

from jaxrl_hex import cli
from jaxrl_hex.metrics import read_jsonl

SMALL_FLAGS = [f"--config.{k}={v}" for k, v in SMALL.items()]


def _error(capsys, argv):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("jaxrl-hex: error: ") and "\n" not in err, err
  return err


def test_unknown_config_key(capsys, tmp_path):
  err = _error(capsys, ["train", f"--workdir={tmp_path}", "--config.train.stepz=3"])
  assert "unknown config key 'train.stepz'" in err and "max_staleness" in err


def test_mesh_that_needs_more_devices(capsys, tmp_path):
  mesh = tmp_path / "big.yaml"
  mesh.write_text("platform: cpu\nnum_devices: 8\npools:\n  train: {devices: 8, mesh: {fsdp: 8}}\n"
                  "  rollout: {devices: 4, mesh: {data: 4}}\n")
  err = _error(capsys, ["train", f"--workdir={tmp_path}/w", f"--config.mesh_file={mesh}"])
  assert "num_devices is 8" in err and "device ids up to 11" in err


def test_batch_that_does_not_divide_the_data_axis(capsys, tmp_path):
  err = _error(
      capsys,
      ["train", f"--workdir={tmp_path}", "--config.rollout.prompts_per_step=3", "--config.rollout.group_size=3"])
  assert "rollout.prompts_per_step x rollout.group_size = 9" in err and "multiple of 2" in err


def test_missing_task_file_and_function(capsys, tmp_path):
  err = _error(capsys, ["train", f"--workdir={tmp_path}", "--config.task=nowhere/task.py:make_task"])
  assert "nowhere/task.py" in err and "does not exist" in err
  task = os.path.join(ROOT, "tests", "fixtures", "reverse_task.py")
  err = _error(capsys, ["train", f"--workdir={tmp_path}", f"--config.task={task}:make_it"])
  assert "no function 'make_it'" in err


def test_resume_on_an_empty_workdir(capsys, tmp_path):
  err = _error(capsys, ["train", f"--workdir={tmp_path}", "--resume"])
  assert "has no run to resume from (no config.json); drop --resume" in err


def test_user_task_file_plugs_in_through_the_cli(capsys, tmp_path):
  task = os.path.join(ROOT, "tests", "fixtures", "reverse_task.py")
  workdir = tmp_path / "rev"
  code = cli.main([
      "train", f"--workdir={workdir}", f"--config.task={task}:make_task", "--config.model.vocab_size=0",
      "--config.sft.max_steps=30", "--config.sft.eval_every=10", "--config.train.steps=3", "--config.train.eval_size=8",
      "--config.sft.eval_size=8", "--config.rollout.max_new_tokens=4", *SMALL_FLAGS[:2]
  ])
  assert code == 0
  rows = read_jsonl(workdir / "metrics.jsonl")
  assert [r["step"] for r in rows if r["phase"] == "train"] == [0, 1, 2, 3]
  assert (workdir / "summary.json").exists()


def _cli(workdir, *extra):
  env = dict(os.environ, JAXRL_HEX_QUIET="1")
  return [
      sys.executable, "-m", "jaxrl_hex.cli", "train", f"--workdir={workdir}", *SMALL_FLAGS, "--config.train.steps=9",
      "--config.train.checkpoint_every=3", "--config.train.max_staleness=0", "--config.train.eval_every=100", *extra
  ], env


def _rows(workdir):
  """The train rows of metrics.jsonl, also while a run writes it (a line half-written is left out)."""
  path, rows = workdir / "metrics.jsonl", []
  for line in path.read_text().splitlines() if path.exists() else []:
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return [r for r in rows if r.get("phase") == "train"]


def _wait_for(proc, done, what):
  deadline = time.time() + 300
  while not done() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  assert proc.poll() is None, f"the run ended before {what}"


def test_kill_then_sigterm_and_two_resumes_train_like_an_uninterrupted_run(tmp_path, warm_workdir):
  """kill -9 once checkpoint 3 exists, --resume; SIGTERM the resumed run mid-way (a preempted VM):
  it checkpoints the step in flight (none is due) and exits 3 with the resume line; --resume
  finishes. One row per step, every batch and prompt once, and at eta = 0 the losses of an
  uninterrupted run of the same command."""
  init = f"--config.init_from={warm_workdir}"
  cmd, env = _cli(tmp_path / "whole", init)
  assert cli.main(cmd[3:]) == 0  # in this process: the same programs as the subprocesses compile
  whole = {r["step"]: r for r in _rows(tmp_path / "whole")}
  workdir = tmp_path / "preempted"

  cmd, env = _cli(workdir, init)
  proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  _wait_for(proc, (workdir / "checkpoints" / "3").exists, "checkpoint 3")
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_at = _rows(workdir)[-1]["step"]
  assert killed_at < 9

  cmd, env = _cli(workdir, init, "--resume")
  proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  _wait_for(proc, lambda: any("resumed_from" in r for r in _rows(workdir)), "its first resumed step")
  proc.send_signal(signal.SIGTERM)
  err = proc.communicate(timeout=300)[1].strip().splitlines()
  assert proc.returncode == 3, err
  stopped = int(err[-1].split(" at step ")[1].split()[0])
  assert f"stopped by SIGTERM at step {stopped} (checkpoint {stopped} written)" in err[-1] and "--resume" in err[-1]
  assert stopped < 9 and (workdir / "checkpoints" / str(stopped)).is_dir()

  subprocess.run(cmd, env=env, check=True, cwd=ROOT, capture_output=True)
  rows = _rows(workdir)
  assert [r["step"] for r in rows] == list(range(10))  # one row per step: the killed run's later ones went
  resumes = [r["resumed_from"] for r in rows if "resumed_from" in r]
  assert resumes[0] in (3, 6) and resumes[1] == stopped and rows[stopped + 1]["resumed_from"] == stopped
  assert [r["batch"] for r in rows[1:]] == list(range(9))
  prompts = [p for r in rows[1:] for p in r["prompt_ids"]]
  assert len(prompts) == len(set(prompts))  # every prompt trained once
  for r in rows[1:]:
    want = whole[r["step"]]
    assert r["policy_version"] == want["policy_version"] and r["reward_mean"] == want["reward_mean"]
    # GRPO's loss is ~0 (advantages cancel within a group): compare it at fp32 rounding of its
    # O(1) terms, and the gradient norm, which is not ~0, tightly
    assert r["loss"] == pytest.approx(want["loss"], abs=1e-6)
    assert r["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def _train(workdir, *flags):
  return cli.main(["train", f"--workdir={workdir}", *flags])


def test_resume_continues_with_the_saved_config_and_refuses_what_cannot_change(capsys, tmp_path, resumed_run):
  """On conftest's resumed_run (SMALL, resumed through the CLI with only --config.train.steps) and a copy of it."""
  # only the flags given on the resume line changed: steps, not the saved eval period or batch
  config = json.load(open(os.path.join(resumed_run, "config.json")))
  assert config["train"]["steps"] == RESUMED_STEPS and config["train"]["eval_every"] == SMALL["train.eval_every"]
  assert config["rollout"]["prompts_per_step"] == SMALL["rollout.prompts_per_step"]
  last = json.load(open(os.path.join(resumed_run, "summary.json")))  # the resumed process's summary
  assert (last["steps"], last["resumed_from"]) == (RESUMED_STEPS - RESUMED_AT, RESUMED_AT)
  rows = [r for r in read_jsonl(os.path.join(resumed_run, "metrics.jsonl")) if r["phase"] == "train"]
  assert [r["step"] for r in rows] == list(range(RESUMED_STEPS + 1))
  assert rows[RESUMED_AT + 1]["resumed_from"] == RESUMED_AT

  workdir = tmp_path / "run"
  shutil.copytree(resumed_run, workdir, ignore=shutil.ignore_patterns("report"))  # test_report writes one there
  saved, summary = (workdir / "config.json").read_text(), (workdir / "summary.json").read_text()
  # a finished run, a field the checkpoint fixes, --config with --resume: one line each, nothing rewritten
  assert f"is done (checkpoint {RESUMED_STEPS}, train.steps={RESUMED_STEPS}); raise --config.train.steps" in _error(
      capsys, ["train", f"--workdir={workdir}", "--resume"])
  d_model = json.loads(saved)["model"]["d_model"]
  err = _error(capsys, ["train", f"--workdir={workdir}", "--resume", f"--config.model.d_model={2 * d_model}"])
  assert f"model.d_model cannot change on resume (the run was saved with {d_model})" in err
  assert "drop --config=configs/grpo.py" in _error(
      capsys, ["train", f"--workdir={workdir}", "--resume", "--config=configs/grpo.py", "--config.train.steps=9"])
  assert "add --resume" in _error(capsys, ["train", f"--workdir={workdir}", f"--step={RESUMED_AT}"])
  assert (workdir / "config.json").read_text() == saved and (workdir / "summary.json").read_text() == summary

  # a damaged newest checkpoint: one line, the older one resumed, the damaged one moved aside
  (workdir / "checkpoints" / str(RESUMED_STEPS) / "meta" / "metadata").write_text("garbage{")
  capsys.readouterr()
  # 9 steps, as the kill test: train.steps is compiled into the update (its lr schedule), one program for both
  assert _train(workdir, "--resume", "--config.train.steps=9") == 0
  err = capsys.readouterr().err
  assert f"checkpoint {RESUMED_STEPS} is damaged: it does not restore (JSONDecodeError" in err
  assert "Traceback" not in err
  assert f"resuming from checkpoint {RESUMED_AT}, the newest intact one" in err
  assert [p.name.split("-")[0] for p in (workdir / "checkpoints" / "superseded").iterdir()] == [str(RESUMED_STEPS)]
  rows = [r for r in read_jsonl(workdir / "metrics.jsonl") if r["phase"] == "train"]
  assert [r["step"] for r in rows] == list(range(10)) and rows[RESUMED_AT + 1]["resumed_from"] == RESUMED_AT
  assert "--step=5: no checkpoint 5" in _error(
      capsys, ["train", f"--workdir={workdir}", "--resume", "--step=5", "--config.train.steps=10"])


def test_a_diverging_run_skips_non_finite_updates_and_stops_in_one_line(capsys, tmp_path, warm_workdir):
  workdir = tmp_path / "diverge"
  code = _train(workdir, *SMALL_FLAGS, f"--config.init_from={warm_workdir}", "--config.optim.lr=1e30",
                "--config.optim.warmup_steps=0", "--config.optim.grad_clip=1e30", "--config.train.steps=8",
                "--config.train.max_nonfinite_steps=2")
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 3 and len(err) == 1 and "steps in a row had a non-finite loss or gradient" in err[0], err
  rows = [r for r in read_jsonl(workdir / "metrics.jsonl") if r["phase"] == "train" and "loss" in r]
  assert [r["nonfinite_updates"] for r in rows][-2:] == [1.0, 1.0] and rows[-1]["step"] < 8


def test_every_command_shares_help_errors_and_exit_codes(capsys):
  for name in cli.COMMANDS:
    assert cli.main([name, "--help"]) == 0, name
    assert capsys.readouterr().out.startswith(f"usage: jaxrl-hex {name}"), name
    err = _error(capsys, [name, "--no-such-flag"])
    assert "--no-such-flag" in err or f"{name}:" in err or "launch needs" in err, err
  assert cli.main(["--version"]) == 0 and capsys.readouterr().out.startswith("jaxrl-hex ")
  assert "unknown command 'trian'" in _error(capsys, ["trian"])


def test_config_overrides_parse_as_their_field_and_name_it(capsys, tmp_path):
  err = _error(capsys, ["train", f"--workdir={tmp_path}", "--config.train.steps=many"])
  assert err == "jaxrl-hex: error: --config.train.steps='many' is not a int (the field's default is 400)"
  err = _error(capsys, ["sft", f"--workdir={tmp_path}", "--config.sft.max_steps"])
  assert "--config.sft.max_steps needs a value" in err


def test_sft_writes_a_summary_that_its_metrics_agree_with(warm_workdir):
  summary = json.loads(open(os.path.join(warm_workdir, "summary.json")).read())
  rows = read_jsonl(os.path.join(warm_workdir, "metrics.jsonl"))
  evals = [r for r in rows if r.get("eval_accuracy") is not None]
  assert summary["steps"] == rows[-1]["step"] > 0 and summary["eval_accuracy_end"] == evals[-1]["eval_accuracy"]
  assert summary["eval_accuracy_start"] == evals[0]["eval_accuracy"] and summary["eval_accuracy_end"] >= 0.2
  assert 0 < summary["seconds"] < summary["wall_seconds"]


def test_closing_line_names_where_the_first_accuracy_was_measured():
  from jaxrl_hex.commands import closing_line
  rl = {"steps": 4, "eval_accuracy_start": 0.5, "eval_accuracy_end": 0.75, "wall_seconds": 12.0}
  warm = dict(rl, warmstart={"eval_accuracy_end": 0.4}, resumed_from=None)
  assert closing_line("train", warm) == "held-out accuracy 0.400 -> 0.750 (warm start -> end of RL), wall time 12s"
  assert "0.500 -> 0.750 (resumed at step 6 -> end of RL)" in closing_line("train", dict(rl, resumed_from=6))
  assert "0.500 -> 0.750 (start of RL -> end of RL)" in closing_line("train", dict(rl, warmstart=None))
  assert "0.500 -> 0.750 (start -> end of SFT, 4 steps)" in closing_line("sft", rl)


@pytest.mark.slow  # ~45 s on 2 cores: two train runs (the fast suite's resume test is the one above)
def test_a_resumed_run_says_where_it_resumed(capsys, tmp_path, warm_workdir):
  workdir = tmp_path / "run"
  assert _train(workdir, *SMALL_FLAGS, f"--config.init_from={warm_workdir}", "--config.train.steps=1") == 0
  capsys.readouterr()
  assert _train(workdir, "--resume", "--config.train.steps=2") == 0
  out = capsys.readouterr().out
  assert "(resumed at step 1 -> end of RL)" in out and "warm start" not in out, out
  assert json.loads((workdir / "summary.json").read_text())["resumed_from"] == 1
