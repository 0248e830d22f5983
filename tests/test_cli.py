"""The command line as a user meets it: one-line errors for bad input, user tasks, resume."""
import os
import signal
import subprocess
import sys
import time

import pytest
from support import ROOT, SMALL

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
  assert "has no checkpoint to resume from" in err


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


def test_kill_and_resume_continues_with_the_same_batches_and_losses(tmp_path, warm_workdir):
  init = f"--config.init_from={warm_workdir}"
  cmd, env = _cli(tmp_path / "whole", init)
  subprocess.run(cmd, env=env, check=True, cwd=ROOT, capture_output=True)
  whole = {r["step"]: r for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl") if r["phase"] == "train"}

  cmd, env = _cli(tmp_path / "killed", init)
  proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt = tmp_path / "killed" / "checkpoints" / "3"
  deadline = time.time() + 300
  while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed = [r for r in read_jsonl(tmp_path / "killed" / "metrics.jsonl") if r["phase"] == "train"]
  assert killed[-1]["step"] < 9, "the run finished before it could be killed"

  cmd, env = _cli(tmp_path / "killed", init, "--resume")
  subprocess.run(cmd, env=env, check=True, cwd=ROOT, capture_output=True)
  rows = read_jsonl(tmp_path / "killed" / "metrics.jsonl")
  resumed_from = [r for r in rows if r["phase"] == "train" and "loss" not in r][-1]["step"]
  assert resumed_from in (3, 6)
  resumed = [r for r in rows if r["phase"] == "train" and "loss" in r][-(9 - resumed_from):]
  for r in resumed:
    want = whole[r["step"]]
    assert r["batch"] == want["batch"] and r["policy_version"] == want["policy_version"]
    # GRPO's loss is ~0 (advantages cancel within a group): compare it at fp32 rounding of its
    # O(1) terms, and the gradient norm, which is not ~0, tightly
    assert r["loss"] == pytest.approx(want["loss"], abs=1e-6)
    assert r["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert r["reward_mean"] == want["reward_mean"]


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
