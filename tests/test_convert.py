"""jaxrl-hex convert --to-hf: a directory transformers loads whole (weights, tokenizer, chat template,
generation_config.json) whose greedy continuations are the run's engine's; --from-hf's and
--from-gguf's next steps run as printed. LoRA runs (--to-hf merged, --to-peft, --from-peft): tests/test_lora_run.py."""
import json
import os
import shlex
import shutil

import numpy as np
import pytest
from gguf_support import write_gguf
from hf_support import save_tiny, save_tokenizer
from support import ROOT, load_config

from jaxrl_hex import cli
from jaxrl_hex.models import model_dir as model_dirs
from jaxrl_hex.models.hf import hf_model_config
from jaxrl_hex.models.safetensors_files import SafetensorsDir
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


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
  """A tiny Llama GGUF (tests/gguf_support.py) -> (its path, the Hugging Face weights it stores)."""
  path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
  return path, write_gguf(path)


def test_from_gguf_writes_a_model_directory_and_prints_how_to_train_on_it(gguf_file, tmp_path, capsys):
  path, stored = gguf_file
  out = str(tmp_path / "hf")
  assert cli.main(["convert", f"--from-gguf={path}", f"--out={out}", "--dtype=bfloat16"]) == 0
  printed = capsys.readouterr().out.strip().splitlines()[-1]
  assert printed.startswith(f"wrote {out}: a Hugging Face model directory (llama, 2 layers, bfloat16)")
  command = shlex.split(printed.partition("train on it (or on the .gguf itself): ")[2])
  assert command[:3] == ["jaxrl-hex", "train", "--config=configs/gsm8k_files.py"]
  assert f"--config.model_dir={out}" in command
  assert hf_model_config(out).param_dtype == "bfloat16"
  weights = SafetensorsDir(out)
  assert weights.entries["lm_head.weight"].dtype == np.dtype("bfloat16")
  np.testing.assert_array_equal(weights.read("model.layers.1.self_attn.q_proj.weight", (slice(None),) * 2),
                                stored["model.layers.1.self_attn.q_proj.weight"].astype("bfloat16"))
  assert HFTokenizer(out).chat_template is not None
  assert cli.main(["convert", f"--from-gguf={path}", f"--out={out}"]) == 2  # not into a non-empty directory
  assert "is not empty; pick an empty directory, or pass --force" in capsys.readouterr().err
  assert cli.main(["convert", f"--from-gguf={path}", f"--out={out}", "--force"]) == 0
  assert hf_model_config(out).param_dtype == "float32"


def test_from_hf_takes_a_gguf_and_records_the_file(gguf_file, tmp_path, monkeypatch, capsys):
  monkeypatch.setenv(model_dirs.CACHE_ENV, str(tmp_path / "cache"))
  path, _ = gguf_file
  run = str(tmp_path / "run")
  assert cli.main(["convert", f"--from-hf={path}", f"--out={run}"]) == 0
  assert f"--config.model_dir={path} --config.init_from={run}" in capsys.readouterr().out
  saved = json.load(open(os.path.join(run, "config.json")))
  assert saved["model_dir"] == path and saved["model"]["n_layers"] == 2
  assert os.listdir(os.path.join(run, "checkpoints")) == ["0"]


def test_gguf_refusals_are_one_line_naming_the_fix(gguf_file, tmp_path, capsys):
  path, out = gguf_file[0], f"--out={tmp_path / 'out'}"
  (tmp_path / "notes.txt").write_text("not a model")
  gemma = str(tmp_path / "gemma.gguf")
  write_gguf(gemma, architecture="gemma3")
  cases = [
      ([f"--from-gguf={path}", out, "--step=1"], "--from-gguf reads one file, drop --step"),
      ([f"--from-gguf={path}", out, "--mesh-file=meshes/cpu-8.yaml"], "places no weights on devices; drop --mesh-file"),
      ([f"--from-gguf={tmp_path / 'absent.gguf'}", out], "absent.gguf: no such file; give the .gguf file's path"),
      ([f"--from-gguf={tmp_path / 'notes.txt'}", out], "notes.txt: not a GGUF file (it starts with b'not '"),
      ([f"--from-gguf={gemma}", out], "general.architecture='gemma3' is not one we load; supported: llama, qwen2"),
      ([f"--from-hf={tmp_path / 'notes.txt'}", out], "--from-hf="),
  ]
  for argv, message in cases:
    assert cli.main(["convert", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # ~60 s on 2 busy cores: a train step's and the engine's compiles
def test_from_gguf_prints_a_next_step_that_runs_as_printed(gguf_file, tmp_path, capsys):
  out = str(tmp_path / "hf")
  assert cli.main(["convert", f"--from-gguf={gguf_file[0]}", f"--out={out}"]) == 0
  printed = capsys.readouterr().out.strip().splitlines()[-1]
  command = shlex.split(printed.partition("train on it (or on the .gguf itself): ")[2])
  command = [
      f"--config.task_args.train_file={SAMPLE}" if a.startswith("--config.task_args.train_file=") else a
      for a in command
  ]
  small = [
      "--config.train.steps=1", "--config.train.eval_size=8", "--config.rollout.prompts_per_step=8",
      "--config.rollout.group_size=2", "--config.task_args.eval_size=8"
  ]  # the printed line with the sample's data, made quick
  assert cli.main(command[1:] + [f"--workdir={tmp_path / 'run'}", *small]) == 0
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert any(r.get("phase") == "train" and np.isfinite(r.get("loss", np.nan)) for r in rows)
