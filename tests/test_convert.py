"""jaxrl-hex convert --to-hf: a directory transformers loads whole (weights, tokenizer, chat template,
generation_config.json) whose greedy continuations are the run's engine's; and --from-hf's next step
runs as printed. LoRA runs (--to-hf merged, --to-peft, --from-peft): tests/test_lora_run.py."""
import json
import os
import shlex
import shutil

import numpy as np
import pytest
from hf_support import save_tiny, save_tokenizer
from support import ROOT, load_config

from jaxrl_hex import cli
from jaxrl_hex.models.hf import hf_model_config
from jaxrl_hex.models.tokenizer import HFTokenizer
from jaxrl_hex.tasks import load_task

SAMPLE = os.path.join(ROOT, "tests", "models", "data", "gsm8k_sample.jsonl")


def _engine_greedy(workdir, prompts, tmp_path, max_new_tokens=None):
  """The run's own engine (`jaxrl-hex generate --greedy`): prompt -> completion text."""
  path, out = tmp_path / "prompts.jsonl", tmp_path / "engine.jsonl"
  path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
  flags = [f"--max-new-tokens={max_new_tokens}"] if max_new_tokens else []
  assert cli.main(["generate", f"--workdir={workdir}", f"--prompts={path}", f"--out={out}", "--greedy", *flags]) == 0
  rows = {r["id"]: r["completion"] for r in map(json.loads, out.read_text().splitlines())}
  return [rows[i] for i in range(len(prompts))]


def _hf_greedy(model, ids, tok, max_new_tokens=None):
  """transformers' greedy generate() on the exported directory, to its generation_config's limits."""
  import torch
  limit = {"max_new_tokens": max_new_tokens} if max_new_tokens else {}
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         **limit)
  return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_char_tokenizer_run_exports_what_transformers_loads_and_continues_as_the_engine(warm_workdir, tmp_path, capsys):
  import transformers
  out = str(tmp_path / "hf")
  assert cli.main(["convert", f"--to-hf={warm_workdir}", f"--out={out}"]) == 0
  said = capsys.readouterr().out
  assert "tokenizer: the task's 12-character tokenizer as tokenizer.json" in said and "no chat template" in said
  gen = json.load(open(os.path.join(out, "generation_config.json")))
  assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 0)
  cfg = load_config()  # the run's rollout sampling, as generate() will sample
  assert gen["max_new_tokens"] == cfg.rollout.max_new_tokens and gen["do_sample"] is True
  assert (gen["temperature"], gen["top_k"], gen["top_p"]) == (cfg.rollout.temperature, 0, 1.0)

  tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert model.generation_config.eos_token_id == 2 and tok.eos_token_id == 2
  prompts = [r["prompt"] for r in load_task("arith", cfg).eval[:12]]
  task_tok = load_task("arith", cfg).tokenizer
  assert tok(prompts[0]).input_ids == [1] + task_tok.encode(prompts[0])  # BOS first, as the engine puts it
  engine = _engine_greedy(warm_workdir, prompts, tmp_path)
  theirs = [_hf_greedy(model, tok(p).input_ids, tok) for p in prompts]
  assert theirs == engine and sum(t.isdigit() for t in engine) >= 6  # a warm-started model answers in digits

  assert cli.main(["convert", f"--to-hf={warm_workdir}", f"--out={out}"]) == 2  # not into a non-empty directory
  assert "is not empty; pick an empty directory, or pass --force" in capsys.readouterr().err
  stale = os.path.join(out, "model-00002-of-00002.safetensors")  # an earlier, sharded export's
  open(stale, "w").close()
  assert cli.main(["convert", f"--to-hf={warm_workdir}", f"--out={out}", "--force"]) == 0
  assert not os.path.exists(stale) and os.path.isfile(os.path.join(out, "model.safetensors"))


def test_refusals_are_one_line_before_any_weight_is_read(warm_workdir, tmp_path, capsys):
  out, base = ["--out", str(tmp_path / "out")], f"--base={tmp_path}"
  cases = [
      (["--to-hf", warm_workdir, "--out", warm_workdir], "is the run itself (its config.json would be overwritten)"),
      (["--from-hf", str(tmp_path), "--out", str(tmp_path / "r"), "--force"], "--force: --from-hf never writes over"),
      (["--to-hf", warm_workdir, "--out", str(tmp_path), "--step=x"], "'x' is not a checkpoint"),
      (["--to-peft", warm_workdir, *out], "trained whole weights (model.lora.rank=0), not LoRA adapters; export it"),
      (["--to-peft", warm_workdir, *out, "--dtype=bfloat16"], "--to-peft writes the adapters in float32"),
      (["--to-hf", warm_workdir, *out, base], "names the model a --from-peft adapter sits on"),
      (["--from-peft", str(tmp_path), *out], "--from-peft needs --base=MODEL_DIR"),
      (["--from-peft", str(tmp_path), base, *out, "--step=1"], "--from-peft writes step 0, drop --step"),
      (["--from-peft", str(tmp_path), base, *out], f"--from-peft: {tmp_path}: no adapter_config.json"),
  ]
  (tmp_path / "something").write_text("")
  for argv, message in cases:
    assert cli.main(["convert", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny random Qwen2 with a tokenizer (chat template, no BOS) trained on the GSM8K sample."""
  path = str(tmp_path_factory.mktemp("qwen"))
  texts = [r["question"] + " " + r["answer"] for r in map(json.loads, open(SAMPLE))] * 4
  vocab = save_tokenizer(path, texts, vocab_size=300)
  save_tiny("qwen2", path, vocab_size=-(-vocab // 8) * 8)
  return path


def test_model_dir_run_exports_its_tokenizer_chat_template_and_ids(hf_dir, tmp_path, capsys):
  import transformers
  init, run, out = (str(tmp_path / n) for n in ("init", "run", "hf"))
  assert cli.main(["convert", f"--from-hf={hf_dir}", f"--out={init}"]) == 0
  capsys.readouterr()
  # a GSM8K run on it: its task reads prompts with the model's tokenizer and chat template
  shutil.copytree(os.path.join(init, "checkpoints"), os.path.join(run, "checkpoints"))
  cfg = load_config("configs/gsm8k_grpo.py", **{
      "model_dir": hf_dir,
      "task_args.train_file": SAMPLE,
      "task_args.eval_size": 4
  })
  cfg.model = hf_model_config(hf_dir)  # as the run saved it: the architecture is config.json's
  with open(os.path.join(run, "config.json"), "w") as f:
    f.write(cfg.to_json_best_effort())
  assert cli.main(["convert", f"--to-hf={run}", f"--out={out}"]) == 0
  assert f"tokenizer: {hf_dir}'s files with its chat template; AutoTokenizer puts no BOS" in capsys.readouterr().out
  ours = HFTokenizer(hf_dir)
  tok = transformers.AutoTokenizer.from_pretrained(out)
  messages = [{"role": "user", "content": "What is 2+3?"}]
  assert tok.apply_chat_template(messages, tokenize=False,
                                 add_generation_prompt=True) == ours.apply_chat_template(messages)
  gen = json.load(open(os.path.join(out, "generation_config.json")))
  assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (ours.bos_id, ours.eos_id, ours.pad_id)
  assert "do_sample" not in gen  # the checkpoint is a --from-hf copy: it never sampled, the source's defaults stay

  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  prompts = [ours.prompt(q) for q in ("A baker makes 14 loaves.", "How many clips did she sell?")]  # user turns
  engine = _engine_greedy(run, prompts, tmp_path, max_new_tokens=12)
  theirs = [
      _hf_greedy(model, [ours.bos_id] + tok(p, add_special_tokens=False).input_ids, tok, max_new_tokens=12)
      for p in prompts
  ]
  assert theirs == engine and all(engine)


@pytest.mark.slow  # ~36 s on 2 cores: a train step's and the engine's compiles
def test_from_hf_prints_a_next_step_that_runs_as_printed(hf_dir, tmp_path, capsys):
  init = str(tmp_path / "init")
  assert cli.main(["convert", f"--from-hf={hf_dir}", f"--out={init}", "--dtype=bfloat16"]) == 0
  printed = capsys.readouterr().out.strip().splitlines()[-1]
  command = shlex.split(printed.partition("start a run from it: ")[2])
  assert command[:2] == ["jaxrl-hex", "train"]
  small = [
      "--config.train.steps=1", "--config.train.eval_size=8", "--config.rollout.prompts_per_step=8",
      "--config.rollout.group_size=2"
  ]  # the printed line, made quick
  assert cli.main(command[1:] + [f"--workdir={tmp_path / 'run'}", *small]) == 0
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert any(r.get("phase") == "train" and np.isfinite(r.get("loss", np.nan)) for r in rows)
