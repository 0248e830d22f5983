"""The files task: a field mapping over JSONL / Parquet columns, the GSM8K recipe laid out that way,
one-line errors, and a Parquet and a JSONL task that train and resume exactly."""
import json
import os
import random
import shutil

import ml_collections
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import ROOT, SMALL, load_config

from jaxrl_hex import cli
from jaxrl_hex.data.files import DataFileError
from jaxrl_hex.data.prompts import PromptStream
from jaxrl_hex.errors import UserError
from jaxrl_hex.metrics import read_jsonl
from jaxrl_hex.tasks import TaskError, load_task
from jaxrl_hex.tasks.files import ARGS

SAMPLE = os.path.join(ROOT, "tests", "models", "data", "gsm8k_sample.jsonl")


def _sums(n=300, seed=0):
  """2-digit additions as a user's table: the question, the sum (an int in Parquet), another column."""
  pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
  random.Random(seed).shuffle(pairs)
  return [{"source": "synthetic", "question": f"{a}+{b}=", "sum": a + b} for a, b in pairs[:n]]


def _write(tmp_path, rows):
  parquet, jsonl = str(tmp_path / "sums.parquet"), str(tmp_path / "sums.jsonl")
  pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=64)
  with open(jsonl, "w") as f:
    f.writelines(json.dumps(dict(r, sum=str(r["sum"]))) + "\n" for r in rows)
  return parquet, jsonl


def _config(**task_args):
  cfg = load_config(**SMALL)
  cfg.task = "files"
  cfg.task_args = ml_collections.ConfigDict(dict(ARGS, **task_args))
  return cfg


def test_field_mapping_prompt_format_and_held_out_split(tmp_path):
  rows = _sums(20)
  parquet, jsonl = _write(tmp_path, rows)
  for path in (parquet, jsonl):
    task = load_task(
        "files",
        _config(train_file=path, prompt_field="question", answer_field="sum", eval_size=4, instruction="(2 digits)",
                prompt_format="Q: {prompt} A:"), check_prompts=True)
    assert (len(task.train), len(task.eval)) == (16, 4)
    assert task.eval[0] == {"prompt": f"Q: {rows[0]['question']}\n(2 digits) A:", "answer": str(rows[0]["sum"])}
    assert task.train[0]["answer"] == str(rows[4]["sum"])
    assert task.reward("", f" {rows[0]['sum']} ", task.eval[0]["answer"]) == 1.0  # "exact": the completion, stripped
    text = "".join(r["prompt"] + r["answer"] for r in [*task.train, *task.eval])
    assert task.tokenizer.chars == "".join(sorted(set(text)))  # a char tokenizer over both splits


def test_gsm8k_laid_out_in_parquet_reads_as_the_gsm8k_task(tmp_path):
  """configs/gsm8k_files.py over the sample's columns, from JSONL and from Parquet: the records of
  the JSONL recipe (configs/gsm8k_grpo.py), chat template and final answers included."""
  from hf_support import save_tokenizer
  rows = [json.loads(line) for line in open(SAMPLE)]
  save_tokenizer(str(tmp_path), [r["question"] + " " + r["answer"] for r in rows], vocab_size=300)
  parquet = str(tmp_path / "gsm8k.parquet")
  pq.write_table(pa.Table.from_pylist(rows), parquet)
  want = load_task(
      "jaxrl_hex.tasks.gsm8k:make_task",
      load_config("configs/gsm8k_grpo.py", **{
          "model_dir": str(tmp_path),
          "task_args.train_file": SAMPLE,
          "task_args.eval_size": 4
      }))
  for path in (SAMPLE, parquet):
    cfg = load_config("configs/gsm8k_files.py", **{
        "model_dir": str(tmp_path),
        "task_args.train_file": path,
        "task_args.eval_size": 4
    })
    task = load_task(cfg.task, cfg)
    assert (list(task.train), list(task.eval)) == (want.train, want.eval)
    assert task.eval[0]["prompt"].startswith("<|im_start|>user\nA baker") and task.eval[0]["answer"] == "23"
    assert task.reward("", "so \\boxed{23}", "23") == 1.0
  cfg.task_args.system_prompt = "Be brief."
  assert load_task(cfg.task, cfg).eval[0]["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_system_field_and_a_reward_from_a_file(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text('{"p": "1+1=", "a": "2", "sys": "S1"}\n{"p": "2+2=", "a": "4", "sys": "S2"}\n')
  reward = tmp_path / "reward.py"
  reward.write_text("def score(prompt, completion, answer):\n  return 0.5 * (completion == answer)\n")
  task = load_task(
      "files",
      _config(train_file=str(path), eval_file=str(path), prompt_field="p", answer_field="a", system_field="sys",
              prompt_format="{system}|{prompt}", reward=f"{reward}:score"))
  assert [r["prompt"] for r in task.eval] == ["S1|1+1=", "S2|2+2="]
  assert task.reward("", "2", "2") == 0.5


COLUMNS = r"its columns: \['source', 'question', 'sum'\]"
BAD_ARGS = [
    (dict(train_file=""), TaskError, "task files: set --config.task_args.train_file"),
    (dict(answer_field="total"), DataFileError,
     r"task_args.answer_field='total': .*sums.parquet has no such column; " + COLUMNS),
    (dict(reward="close"), TaskError, r"task_args.reward='close': expected one of \['exact', "),
    (dict(reward="nowhere.py:f"), UserError, "task_args.reward: file 'nowhere.py' does not"),
    (dict(prompt_format="{question}"), TaskError, "task_args.prompt_format='{question}': "),
    (dict(reward="math", answer_field="source"), DataFileError, "sums.parquet row 0: 'source' has no final number"),
    (dict(prompt_field="sum"), DataFileError, "'sum' is int, not text"),
    (dict(eval_size=300), TaskError, "the eval split is empty"),  # 1 record: none held out
]


@pytest.mark.parametrize("args, error, message", BAD_ARGS)
def test_bad_task_args_are_one_line(tmp_path, args, error, message):
  parquet, _ = _write(tmp_path, _sums(1))
  cfg = _config(**{"train_file": parquet, "prompt_field": "question", "answer_field": "sum", **args})
  with pytest.raises(error, match=message):
    load_task("files", cfg, check_prompts=True)


def test_the_default_config_says_where_the_fields_are():
  with pytest.raises(TaskError, match="no task_args.train_file; start from --config=configs/gsm8k_files.py"):
    load_task("files", load_config())


CONFIG = """
import ml_collections

from jaxrl_hex.config import load_config_file
from jaxrl_hex.tasks.files import ARGS


def get_config():
  cfg = load_config_file({arith!r})
  cfg.task = "files"
  cfg.task_args = ml_collections.ConfigDict(dict(ARGS, train_file={train!r}, prompt_field="question",
                                                 answer_field="sum", eval_size=64))
  return cfg
"""


def _train(workdir, *flags):
  assert cli.main(["train", f"--workdir={workdir}", *flags]) == 0
  return {r["step"]: r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r["phase"] == "train"}


def test_a_parquet_and_a_jsonl_task_train_and_resume_exactly(tmp_path, warm_workdir):
  """The same table as Parquet and as JSONL, each trained 6 steps, and the JSONL run resumed from its
  checkpoint 3: every step draws the prompt stream's next batch (the resumed ones too), and all three
  train alike."""
  parquet, jsonl = _write(tmp_path, _sums())
  run = [  # 6 steps (the lr schedule, compiled into the update) as conftest's resumed_run: its programs
      *(f"--config.{k}={v}" for k, v in SMALL.items()), f"--config.init_from={warm_workdir}",
      "--config.train.max_staleness=0", "--config.train.eval_every=100", "--config.train.checkpoint_every=3",
      "--config.train.steps=6"
  ]
  runs = {}
  for name, path in (("parquet", parquet), ("jsonl", jsonl)):
    config = tmp_path / f"{name}_config.py"
    config.write_text(CONFIG.format(arith=os.path.join(ROOT, "configs", "arith_grpo.py"), train=path))
    runs[name] = _train(tmp_path / name, f"--config={config}", *run)
  shutil.copytree(tmp_path / "jsonl", tmp_path / "resumed")
  runs["resumed"] = _train(tmp_path / "resumed", "--resume", "--step=3")
  assert sorted(runs["resumed"]) == list(range(7)) and runs["resumed"][4]["resumed_from"] == 3
  cfg = load_config(str(config))
  stream = PromptStream(load_task(cfg.task, cfg).train, SMALL["rollout.prompts_per_step"], seed=cfg.seed)
  batches = [sorted(r["index"] for r in stream.next()[0]) for _ in range(6)]
  for step in range(1, 7):
    for name in ("jsonl", "resumed"):
      got, want = runs[name][step], runs["parquet"][step]
      assert got["prompt_ids"] == want["prompt_ids"] == batches[step - 1], (name, step)
      assert got["reward_mean"] == want["reward_mean"], (name, step)
      assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), (name, step)
      assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (name, step)
