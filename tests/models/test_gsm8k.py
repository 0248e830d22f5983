"""The GSM8K recipe: answer extraction and reward, then convert -> RL steps -> convert back on a
tiny random Qwen2 with a tokenizer trained on the sample data."""
import json
import os

import numpy as np
import pytest
from hf_support import save_tiny, save_tokenizer, torch_logits
from support import ROOT, load_config

from jaxrl_hex import cli
from jaxrl_hex.tasks import TaskError
from jaxrl_hex.tasks.gsm8k import extract_answer, math_reward, normalize, read_jsonl

SAMPLE = os.path.join(ROOT, "tests", "models", "data", "gsm8k_sample.jsonl")


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("So the total is \\boxed{72}.", "72", 1.0),
        ("3 + 4 = 7, then \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("It costs \\boxed{\\$1,000.00}", "1000", 1.0),
        ("The answer is 25%.", "25", 1.0),
        ("First 12, then 30.\n#### 42", "42", 1.0),
        ("\\boxed{42} was wrong, the answer is \\boxed{41}", "42", 0.0),  # the last box counts
        ("I think 7 or maybe 8", "7", 0.0),  # the last number counts
        ("no number here", "3", 0.0),
        ("\\boxed{x+1}", "x + 1", 1.0),  # non-numeric: compared as text
    ])
def test_math_reward(completion, answer, reward):
  assert math_reward("", completion, answer) == reward


def test_reference_answers_are_the_final_values():
  records = read_jsonl(SAMPLE)
  assert len(records) == 16
  assert records[0]["answer"] == "23" and records[11]["answer"] == "250"  # "#### 250" after "1,250 marbles"
  assert extract_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
  assert normalize("-3.50") == "-7/2"


def test_bad_jsonl_line_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
  with pytest.raises(TaskError, match="bad.jsonl:2: expected a JSON object"):
    read_jsonl(str(path))


def _model_dir(path):
  texts = [r["question"] + " " + r["answer"] for r in map(json.loads, open(SAMPLE))] * 4
  vocab = save_tokenizer(path, texts, vocab_size=300)
  return save_tiny("qwen2", path, vocab_size=-(-vocab // 8) * 8)


def test_recipe_takes_architecture_tokenizer_and_prompts_from_the_model_dir(tmp_path):
  from jaxrl_hex.models.hf import hf_model_config
  from jaxrl_hex.runtime import build_runtime
  _model_dir(str(tmp_path))
  cfg = load_config(
      "configs/gsm8k_grpo.py",
      **{
          "model_dir": str(tmp_path),
          "task_args.train_file": SAMPLE,
          "task_args.eval_size": 4,
          "model.remat": "full",  # how to run it stays the run's (was reset to the defaults)
          "model.logprob_chunk": 96
      })
  rt = build_runtime(cfg)
  want = hf_model_config(str(tmp_path), dtype="bfloat16", param_dtype="float32", remat="full", logprob_chunk=96,
                         scan_layers=cfg.model.scan_layers, attention_block=cfg.model.attention_block,
                         attention_kernel=cfg.model.attention_kernel)
  assert rt.policy.cfg == want and rt.policy.cfg.qkv_bias and rt.policy.cfg.remat == "full"
  assert (len(rt.task.train), len(rt.task.eval)) == (12, 4)
  assert rt.task.eval[0]["prompt"].startswith("<|im_start|>user\nA baker makes 14 loaves")
  assert rt.task.eval[0]["prompt"].endswith("within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
  assert rt.tokenizer.eos_id == rt.tokenizer.encode("<|im_end|>")[0]


def test_recipe_without_model_dir_says_which_field_to_set():
  from jaxrl_hex.runtime import build_runtime
  with pytest.raises(TaskError, match="set --config.model_dir"):
    build_runtime(load_config("configs/gsm8k_grpo.py", **{"task_args.train_file": SAMPLE}))


def test_convert_errors_exit_2_with_one_line(tmp_path, capsys):
  assert cli.main(["convert", "--to-hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
  assert "config.json does not exist" in capsys.readouterr().err
  assert cli.main(["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
  assert "no config.json" in capsys.readouterr().err


@pytest.mark.slow  # ~60 s on 2 cores: two conversions, engine and trainer compiles
def test_recipe_converts_trains_and_exports(tmp_path):
  """HF dir -> convert -> a few GRPO steps of configs/gsm8k_grpo.py -> convert back -> transformers."""
  import transformers
  model_dir, init, run, out = (str(tmp_path / n) for n in ("hf", "init", "run", "out"))
  original = _model_dir(model_dir)
  assert cli.main(["convert", "--from-hf", model_dir, "--out", init]) == 0

  cfg = load_config(
      "configs/gsm8k_grpo.py", **{
          "model_dir": model_dir,
          "init_from": init,
          "task_args.train_file": SAMPLE,
          "task_args.eval_size": 4,
          "model.dtype": "float32",
          "rollout.prompts_per_step": 4,
          "rollout.group_size": 2,
          "rollout.max_new_tokens": 8,
          "rollout.max_prompt_len": 192,
          "train.steps": 2,
          "train.eval_every": 2,
          "train.eval_size": 4,
          "train.checkpoint_every": 2,
          "train.log_every": 1,
          "optim.lr": 1e-3
      })
  from jaxrl_hex import commands
  summary = commands.train(cfg, run)
  rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
  steps = [r for r in rows if r.get("phase") == "train" and "loss" in r]
  assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
  assert summary["eval_accuracy_end"] == 0.0 and all(r["reward_mean"] == 0.0 for r in steps)

  assert cli.main(["convert", "--to-hf", run, "--out", out]) == 0
  assert os.path.isfile(os.path.join(out, "tokenizer.json"))
  exported = transformers.AutoModelForCausalLM.from_pretrained(out)
  ids = np.arange(3, 19)[None]
  from jaxrl_hex.models.hf import from_hf
  np.testing.assert_allclose(torch_logits(exported, ids), np.asarray(from_hf(out)(ids)), atol=1e-4, rtol=0)
  # a random model earns no reward, so GRPO's advantages are 0 and the weights stay the checkpoint's:
  # what went in through convert and init_from is what came out
  np.testing.assert_allclose(torch_logits(exported, ids), torch_logits(original, ids), atol=1e-4, rtol=0)
