"""The best checkpoint of a short real run (train.keep_best, an evaluation every step) and `jaxrl-hex eval`
on it: the best is the run's best recorded evaluation, rotation keeps it, and eval, generate and a resume
use it."""
import json
import os
import shutil

import pytest
from support import ROOT, SMALL, load_config

from jaxrl_hex import cli, commands
from jaxrl_hex.checkpoint import Checkpointer, read_best
from jaxrl_hex.config import read_run_config
from jaxrl_hex.metrics import read_jsonl
from jaxrl_hex.tasks import load_task

STEPS = 5


@pytest.fixture(scope="module")
def run(tmp_path_factory, warm_workdir):
  """5 RL steps, each evaluated; one regular checkpoint (the last) and keep_checkpoints=1."""
  workdir = str(tmp_path_factory.mktemp("best") / "run")
  overrides = {
      "init_from": warm_workdir,
      "train.steps": STEPS,
      "train.eval_every": 1,
      "train.checkpoint_every": STEPS,
      "train.keep_checkpoints": 1,
      "train.keep_best": True
  }
  cfg = load_config(**{**SMALL, **overrides})
  summary = commands.train(cfg, workdir)
  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r["phase"] == "train" and r["step"] > 0]
  accuracy = {r["step"]: r["eval_accuracy"] for r in rows}
  best = max(accuracy, key=lambda s: (accuracy[s], -s))  # the first of the highest: a tie does not beat
  return {"workdir": workdir, "summary": summary, "accuracy": accuracy, "best": best}


def test_the_best_checkpoint_is_the_best_recorded_evaluation_and_rotation_keeps_it(run):
  assert sorted(run["accuracy"]) == list(range(1, STEPS + 1))
  best = {"step": run["best"], "metric": "eval_accuracy", "mode": "max", "value": run["accuracy"][run["best"]]}
  ckpt_dir = os.path.join(run["workdir"], "checkpoints")
  assert read_best(ckpt_dir) == run["summary"]["best"] == best
  assert Checkpointer(ckpt_dir).steps() == sorted({run["best"], STEPS})  # every earlier best went


def test_eval_scores_a_checkpoint_exactly_as_the_run_recorded(run, tmp_path, capsys):
  workdir = run["workdir"]
  out = tmp_path / "best.json"
  assert cli.main(["eval", f"--workdir={workdir}", "--step=best", "--samples=2", f"--out={out}"]) == 0
  result = json.loads(out.read_text())
  assert (result["step"], result["policy_version"], result["records"]) == (run["best"], run["best"], 64)
  assert result["greedy_accuracy"] == run["accuracy"][run["best"]]
  assert 0 <= result["mean@2"] <= result["pass@2"] <= 1 and result["temperature"] == 1.0
  per_record = result["results"]
  assert len(per_record) == 64 and all(len(r["samples"]) == len(r["sample_rewards"]) == 2 for r in per_record)
  assert sum(r["reward"] for r in per_record) / 64 == pytest.approx(result["greedy_accuracy"])
  table = capsys.readouterr().out
  assert f"checkpoint {run['best']} (policy version {run['best']})" in table and f"wrote {out}" in table
  # the same records as a JSONL file, on the latest checkpoint: its step's recorded accuracy
  cfg = read_run_config(workdir)
  task = load_task(cfg.task, cfg)
  prompts = tmp_path / "records.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in task.eval[:64]))
  assert cli.main(["eval", f"--workdir={workdir}", f"--prompts={prompts}"]) == 0
  latest = json.loads(open(os.path.join(workdir, f"eval-{STEPS}.json")).read())
  assert latest["step"] == STEPS and latest["records_from"] == str(prompts)
  assert latest["greedy_accuracy"] == run["accuracy"][STEPS]


def test_generate_samples_from_the_best_checkpoint(run, tmp_path):
  prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
  prompts.write_text('{"prompt": "12+30="}\n')
  assert cli.main(
      ["generate", f"--workdir={run['workdir']}", f"--prompts={prompts}", f"--out={out}", "--step=best",
       "--slots=4"]) == 0
  assert [json.loads(line)["version"] for line in out.read_text().splitlines()] == [run["best"]]


def test_a_resumed_run_goes_on_comparing_with_its_saved_best(run, tmp_path):
  """The checkpoint's best is set out of reach (an accuracy of 2): the resumed step's evaluation, which a
  run that forgot its best would take for one, is no new best."""
  workdir = str(tmp_path / "run")
  shutil.copytree(run["workdir"], workdir)
  meta_file = os.path.join(workdir, "checkpoints", str(STEPS), "meta", "metadata")
  meta = json.loads(open(meta_file).read())
  meta["best"]["value"] = 2.0
  with open(meta_file, "w") as f:
    json.dump(meta, f)
  cfg = read_run_config(workdir)
  cfg.train.steps = STEPS + 1
  summary = commands.train(cfg, workdir, resume=True)
  assert summary["best"] == meta["best"] and meta["best"]["step"] == run["best"]
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  assert ckpt.steps() == sorted({run["best"], STEPS + 1}) and ckpt.resolve("best") == run["best"]
  assert ckpt.meta(STEPS + 1)["best"] == summary["best"]


def test_eval_scores_a_hugging_face_model_dir_with_a_config_s_task(tmp_path, capsys):
  """A tiny random Qwen2 on the GSM8K recipe's task: it earns no reward, and every record is scored."""
  from hf_support import save_tiny, save_tokenizer
  sample = os.path.join(ROOT, "tests", "models", "data", "gsm8k_sample.jsonl")
  texts = [r["question"] + " " + r["answer"] for r in read_jsonl(sample)] * 4
  model_dir = str(tmp_path / "hf")
  save_tiny("qwen2", model_dir, vocab_size=-(-save_tokenizer(model_dir, texts, vocab_size=300) // 8) * 8)
  out = tmp_path / "qwen.json"
  assert cli.main([
      "eval", f"--model-dir={model_dir}", "--config=configs/gsm8k_grpo.py", f"--out={out}", "--samples=2",
      f"--config.task_args.train_file={sample}", "--config.task_args.eval_size=4", "--config.train.eval_size=4",
      "--config.rollout.max_new_tokens=8", "--config.rollout.max_prompt_len=192", "--config.rollout.prompts_per_step=4",
      "--config.rollout.group_size=2", "--config.model.dtype=float32"
  ]) == 0
  result = json.loads(out.read_text())
  assert (result["source"], result["step"], result["policy_version"], result["records"]) == (model_dir, None, 0, 4)
  assert result["greedy_accuracy"] == result["mean@2"] == result["pass@2"] == 0.0
  assert all(r["greedy"] and len(r["samples"]) == 2 for r in result["results"])
  assert "Hugging Face weights: 4 records (task 'gsm8k' eval split)" in capsys.readouterr().out
