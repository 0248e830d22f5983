"""PEFT LoRA adapters against peft + transformers (tiny random Qwen2 / Llama, fp32): ours saved as
PEFT give PeftModel our logits and load back exactly, in either layer layout; adapters peft made
give our model PeftModel's logits; the merged export gives plain transformers our logits; an
adapter on the wrong base or with settings model.lora cannot follow stops with one line."""
import json
import os
import shutil

import jax
import numpy as np
import pytest
from hf_support import save_tiny, torch_logits

from jaxrl_hex.errors import ConfigError
from jaxrl_hex.models import lora
from jaxrl_hex.models.families import HFModelError
from jaxrl_hex.models.hf import CausalLM, hf_model_config, load_params
from jaxrl_hex.models.peft import CONFIG, WEIGHTS, load_peft, lora_config_from_peft, save_merged_hf, save_peft
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.safetensors_files import SafetensorsDir, write_safetensors

LORA = dict(rank=4, alpha=8.0)  # every projection (model.lora.targets' default)


def _model(base_dir, scan=False, **lora_fields):
  """(policy, base params) of the HF model in base_dir with model.lora = LORA + lora_fields."""
  policy = Policy.build(hf_model_config(base_dir, lora=dict(LORA, **lora_fields), scan_layers=scan))
  return policy, load_params(base_dir, policy.cfg, None)


def _random_adapters(policy, seed=0):
  """Adapters with A and B both random (a fresh B is zero, which would hide a transposed factor)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jax.numpy.asarray(rng.normal(0, 0.1, s.shape), np.float32),
                      policy.split(policy.shapes())[0])


def _logits(policy, params, ids):
  return np.asarray(jax.jit(lambda params: CausalLM(policy.module(params))(ids))(params))


def _peft_logits(base_dir, adapter_dir, ids):
  import peft
  import transformers
  base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
  return torch_logits(peft.PeftModel.from_pretrained(base, adapter_dir).eval(), ids)


def _assert_close(ours, theirs, rel=1e-4):
  """Equal within rel of the logits' scale: an element near zero gets no looser or tighter bound."""
  assert np.abs(ours - theirs).max() <= rel * np.abs(theirs).max()


def _assert_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scan_layers"])
def test_our_adapters_give_peft_our_logits_and_load_back_exactly(family, scan, tiny_hf, tmp_path):
  path, _, ids, base_logits, _ = tiny_hf(family)
  policy, base = _model(path, scan)
  adapters = _random_adapters(policy)
  ours = _logits(policy, lora.merge(adapters, base), ids)
  assert np.abs(ours - base_logits).max() > 1.0  # the adapters matter
  save_peft(policy.cfg, adapters, str(tmp_path), base_model_name_or_path=path)
  config = json.load(open(tmp_path / CONFIG))
  assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, path)
  assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
  q = SafetensorsDir(str(tmp_path), WEIGHTS).entries["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
  assert q.shape == (4 * 16, 4) and q.dtype == np.float32  # [heads * head_dim, r]
  _assert_close(ours, _peft_logits(path, str(tmp_path), ids))
  _assert_equal(load_peft(str(tmp_path), policy.cfg), adapters)
  other = Policy.build(hf_model_config(path, lora=LORA, scan_layers=not scan))  # the same factors, (un)stacked
  _assert_equal(_relayout(load_peft(str(tmp_path), other.cfg), policy.cfg.n_layers, stack=scan), adapters)


def _relayout(adapters, n_layers, stack):
  """Adapters per layer -> stacked [L, ...] (stack), or back."""
  layers = adapters["layers"]
  if stack:
    return {"layers": jax.tree.map(lambda *xs: np.stack(xs), *(layers[i] for i in range(n_layers)))}
  return {"layers": {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n_layers)}}


@pytest.mark.parametrize("family, scan", [("qwen2", False), ("llama", True)])
def test_merged_export_gives_plain_transformers_our_logits(family, scan, tiny_hf, tmp_path):
  import transformers
  path, _, ids, _, _ = tiny_hf(family)
  policy, base = _model(path, scan, targets=("q_proj", "o_proj", "down_proj"))
  params = lora.merge(_random_adapters(policy, seed=1), base)
  save_merged_hf(policy.cfg, params, str(tmp_path), source_dir=path)
  assert sorted(SafetensorsDir(str(tmp_path)).entries) == sorted(SafetensorsDir(path).entries)  # no adapter left
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
  _assert_close(_logits(policy, params, ids), torch_logits(merged, ids))


@pytest.mark.parametrize("family, rslora", [("qwen2", False), ("llama", True)])
def test_adapter_made_by_peft_gives_our_model_its_logits(family, rslora, tiny_hf, tmp_path):
  import peft
  import torch
  import transformers
  path, _, ids, _, _ = tiny_hf(family)
  base = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
  made = peft.get_peft_model(
      base,
      peft.LoraConfig(r=4, lora_alpha=6, lora_dropout=0.1, target_modules=["v_proj", "q_proj", "up_proj"],
                      use_rslora=rslora, task_type="CAUSAL_LM"))
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in made.named_parameters():
      if "lora_B" in name:  # zero as peft makes it
        p.copy_(0.1 * torch.randn(p.shape, generator=gen))
  made.save_pretrained(str(tmp_path))
  settings = lora_config_from_peft(str(tmp_path))
  assert settings == dict(rank=4, alpha=12.0 if rslora else 6.0, dropout=0.1, targets=("q_proj", "v_proj", "up_proj"))
  policy = Policy.build(hf_model_config(path, lora=settings))
  adapters = load_peft(str(tmp_path), policy.cfg)
  _assert_close(_logits(policy, lora.merge(adapters, load_params(path, policy.cfg, None)), ids),
                torch_logits(made.eval(), ids))


def test_adapters_load_onto_their_shardings(tiny_hf, pools, tmp_path):
  path = tiny_hf("llama")[0]
  policy, _ = _model(path, scan=True)
  adapters = _random_adapters(policy)
  save_peft(policy.cfg, adapters, str(tmp_path))
  shardings = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
  loaded = load_peft(str(tmp_path), policy.cfg, shardings)
  _assert_equal(loaded, adapters)
  a = loaded["layers"]["mlp"]["up_lora"]["a"]  # [L, embed, r]
  assert a.sharding == shardings["layers"]["mlp"]["up_lora"]["a"] and len(a.sharding.device_set) == 4


@pytest.fixture(scope="module")
def saved(tiny_hf, tmp_path_factory):
  """(base dir, a PEFT adapter of the tiny Llama on q_proj and v_proj, rank 4, alpha 8)."""
  path = tiny_hf("llama")[0]
  policy, _ = _model(path, targets=("q_proj", "v_proj"))
  out = str(tmp_path_factory.mktemp("adapter"))
  save_peft(policy.cfg, _random_adapters(policy), out, base_model_name_or_path="tiny-llama")
  return path, out


def _one_line(excinfo):
  assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("lora_fields, message", [
    (dict(rank=8), r"model.lora.rank=8 but the adapter .* has r=4; set --config.model.lora.rank=4$"),
    (dict(), r"model.lora.targets=\('q_proj', 'k_proj', .*\) adapts \['self_attn.q_proj', .*\] but the adapter .* "
     r"adapts \['self_attn.q_proj', 'self_attn.v_proj'\]; set --config.model.lora.targets=\"\('q_proj', 'v_proj'\)\"$"),
    (dict(targets=("q_proj", "v_proj"), alpha=16.0),
     r"model.lora.alpha=16 but the adapter .* was trained with alpha 8 .*; set --config.model.lora.alpha=8$"),
])
def test_lora_settings_unlike_the_adapters_name_the_field_and_value(saved, lora_fields, message):
  path, adapter = saved
  cfg = hf_model_config(path, lora=dict(LORA, **lora_fields))
  with pytest.raises(ConfigError, match=message) as e:
    load_peft(adapter, cfg)
  _one_line(e)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 48, r"tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape "
     r"\[4, 32\] but model_dir's model implies \[4, 48\]"),
    ("num_hidden_layers", 3, r"tensor 'base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight' is missing"),
    ("num_hidden_layers", 1, r"tensor 'base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight' \(and 3 more\) "
     r"has no place in model_dir's 1-layer model"),
])
def test_adapter_on_another_base_names_the_tensor_and_model_dir(saved, tmp_path, field, value, message):
  _, adapter = saved
  other = str(tmp_path)
  save_tiny("llama", other, **{field: value})
  cfg = hf_model_config(other, lora=dict(LORA, targets=("q_proj", "v_proj")))
  with pytest.raises(HFModelError, match=message + r".*; model_dir must be the adapter's base model \(tiny-llama\)$"):
    load_peft(adapter, cfg)


def _edit_config(adapter, **fields):
  config = json.load(open(os.path.join(adapter, CONFIG)))
  json.dump(dict(config, **fields), open(os.path.join(adapter, CONFIG), "w"))


def _add_tensor(adapter, name):
  entries = SafetensorsDir(adapter, WEIGHTS)
  tensors = {n: entries.read(n, tuple(slice(None) for _ in e.shape)) for n, e in entries.entries.items()}
  tensors[name] = np.zeros((4, 32), np.float32)
  write_safetensors(adapter, [(n, t.shape, t.dtype, lambda t=t: t) for n, t in tensors.items()], single=WEIGHTS)


@pytest.mark.parametrize("edit, message", [
    (lambda d: _edit_config(d, use_dora=True), r"adapter_config.json: use_dora=True is more than plain LoRA .*"
     r"\(model.lora needs use_dora=False\); merge the adapter into its base .* merge_and_unload\(\)"),
    (lambda d: _edit_config(d, modules_to_save=["lm_head"]), r"modules_to_save=\['lm_head'\] is more than plain LoRA"),
    (lambda d: _edit_config(d, layers_to_transform=[0]), r"layers_to_transform=\[0\] is more than plain LoRA"),
    (lambda d: _edit_config(d, peft_type="IA3"), r"peft_type='IA3'; only LORA adapters load into model.lora"),
    (lambda d: os.remove(os.path.join(d, CONFIG)), r"no adapter_config.json; a PEFT adapter directory holds"),
    (lambda d: os.rename(os.path.join(d, WEIGHTS), os.path.join(d, "adapter_model.bin")),
     r"no adapter_model.safetensors; it holds adapter_model.bin \(a pickle\): re-save it with "
     r"PeftModel.save_pretrained\(dir, safe_serialization=True\)"),
    (lambda d: _add_tensor(d, "base_model.model.lm_head.lora_A.weight"),
     r"tensor 'base_model.model.lm_head.lora_A.weight' is not a LoRA factor of a decoder projection"),
])
def test_adapter_that_is_not_plain_lora_is_refused(saved, tmp_path, edit, message):
  path, adapter = saved
  copy = str(tmp_path / "adapter")
  shutil.copytree(adapter, copy)
  edit(copy)
  with pytest.raises(HFModelError, match=message) as e:
    lora_config_from_peft(copy)
  _one_line(e)


def test_saving_adapters_of_a_model_without_them_names_the_field(tiny_hf, tmp_path):
  cfg = hf_model_config(tiny_hf("llama")[0])
  with pytest.raises(ConfigError, match="model.lora.rank=0: the model has no adapters"):
    save_peft(cfg, {}, str(tmp_path))
