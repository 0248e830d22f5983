"""LoRA adapters in and out as PEFT directories, and merged into a full Hugging Face checkpoint.

A PEFT LoRA directory holds adapter_config.json (r, lora_alpha, target_modules, ...) and
adapter_model.safetensors, whose tensors are named after the adapted module of the transformers
model under PeftModel's prefix: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
[r, in] and ...lora_B.weight [out, r]. Ours are models.lora's A [in..., r] and B [r, out...],
the same matrices transposed, with in/out split like the weights they adapt (hf.tensor_layouts),
so both directions reuse hf's TensorMap reading and writing.

  save_peft(cfg, adapters, "out/adapter", base_model_name_or_path="Qwen/Qwen2.5-0.5B")
  model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "out/adapter")
  cfg = hf_model_config(base, lora=lora_config_from_peft("out/adapter"))
  adapters = load_peft("out/adapter", cfg)            # lora.merge(adapters, hf.load_params(base, ...))
  save_merged_hf(cfg, lora.merge(adapters, base_params), "out/merged", source_dir=base)
"""
import json
import math
import os
import re

import numpy as np

from jaxrl_hex.errors import ConfigError
from jaxrl_hex.models import lora
from jaxrl_hex.models.config import LORA_TARGETS, lora_targets
from jaxrl_hex.models.families import HFModelError
from jaxrl_hex.models.hf import TensorMap, param_of, read_tensors, save_hf, tensor_layouts, write_tensors
from jaxrl_hex.models.safetensors_files import SafetensorsDir

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
ONE_FILE = 1 << 62  # max_shard_bytes: peft reads an adapter from one file, never shards
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model: its names gain this
TENSOR = re.compile(re.escape(PREFIX) + r"model\.layers\.\d+\.(.+)\.lora_[AB]\.weight")  # group 1: the module
# adapter_config.json fields that change what an adapter computes beyond x W + (alpha / r) x A B on
# whole projections, with the values that do not; an adapter using one is refused, not misread.
PLAIN = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layers_to_transform": (None, []),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, [], {}),
    "alora_invocation_tokens": (None, []),
    "use_qalora": (False, None),
    "use_bdlora": (False, None),
    "layer_replication": (None, []),
}


def adapter_layouts(cfg) -> list:
  """Every adapter factor of models.decoder.Decoder(cfg) with its PEFT tensor: A [in..., r] is
  lora_A.weight [r, in], B [r, out...] is lora_B.weight [out, r]."""
  targeted = {LORA_TARGETS[name][:2]: name for name in lora_targets(cfg)}
  r = cfg.lora.rank
  out = []
  for lay in tensor_layouts(cfg):  # the weight [in..., out...] as [out, in], groups (in dims, out dims)
    name = targeted.get(lay.path[2:]) if lay.path[0] == "layers" else None
    if name is None:
      continue
    n_in, (ins, outs) = LORA_TARGETS[name][2], lay.groups
    stem, at = PREFIX + lay.hf_name.removesuffix(".weight"), lay.path[:-1] + (lay.path[-1] + lora.SUFFIX,)
    out.append(TensorMap(f"{stem}.lora_A.weight", at + ("a",), lay.shape[:n_in] + (r,), (ins, (n_in,)), True))
    out.append(
        TensorMap(f"{stem}.lora_B.weight", at + ("b",), (r,) + lay.shape[n_in:],
                  ((0,), tuple(i + 1 - n_in for i in outs)), True))
  return out


def save_peft(cfg, adapters: dict, out_dir: str, base_model_name_or_path: str = ""):
  """Writes adapters (a pure dict in models.lora's layout, or whole params holding them; stacked
  or per layer as cfg.scan_layers says) as a PEFT LoRA directory that
  peft.PeftModel.from_pretrained(base model, out_dir) loads. Multi-host: every process calls it,
  process 0 writes."""
  if not cfg.lora.rank:
    raise ConfigError("model.lora.rank=0: the model has no adapters to save as PEFT; train with "
                      "--config.model.lora.rank=16 (say), or export full weights with save_hf")
  os.makedirs(out_dir, exist_ok=True)
  if not write_tensors(cfg, adapters, adapter_layouts(cfg), out_dir, np.float32, ONE_FILE, WEIGHTS):
    return
  alpha = float(cfg.lora.alpha)
  config = {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path or None,
      "r": cfg.lora.rank,
      "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
      "lora_dropout": float(cfg.lora.dropout),
      "target_modules": [name.split(".")[-1] for name in lora_targets(cfg)],
      "bias": "none",
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "modules_to_save": None,
      "layers_to_transform": None,
      "inference_mode": True,
  }
  with open(os.path.join(out_dir, CONFIG), "w") as f:
    json.dump(config, f, indent=2)


def lora_config_from_peft(adapter_dir: str) -> dict:
  """The model.lora settings {rank, alpha, dropout, targets} that a PEFT LoRA adapter was trained
  with, to build the model that load_peft fills (e.g. hf_model_config(base, lora=...))."""
  config, ckpt = _open(adapter_dir)
  settings = _settings(config, ckpt)
  ckpt.close()
  return settings


def load_peft(adapter_dir: str, cfg, shardings=None) -> dict:
  """A PEFT LoRA directory's adapters as a pure dict in models.lora's layout (float32; stacked or
  per layer as cfg.scan_layers says), each created in its sharding (looked up by path in
  `shardings`, e.g. Policy.split(shardings)[0] or a whole params tree; None: the default device).
  cfg: the adapter's base model, with model.lora as lora_config_from_peft gives."""
  config, ckpt = _open(adapter_dir)
  want, ours = _settings(config, ckpt), cfg.lora
  if ours.rank != want["rank"]:
    raise ConfigError(f"model.lora.rank={ours.rank} but the adapter {adapter_dir} has r={want['rank']}; set "
                      f"--config.model.lora.rank={want['rank']}")
  theirs = tuple(name for name in LORA_TARGETS if name.split(".")[-1] in want["targets"])
  if lora_targets(cfg) != theirs:
    raise ConfigError(f"model.lora.targets={tuple(ours.targets)} adapts {list(lora_targets(cfg))} but the adapter "
                      f"{adapter_dir} adapts {list(theirs)}; set --config.model.lora.targets=\"{want['targets']}\"")
  if not math.isclose(ours.alpha, want["alpha"], rel_tol=1e-6):
    raise ConfigError(f"model.lora.alpha={ours.alpha:g} but the adapter {adapter_dir} was trained with alpha "
                      f"{want['alpha']:g} (its scale is alpha / r); set --config.model.lora.alpha={want['alpha']:g}")
  base = "the adapter's base model" + (f" ({config['base_model_name_or_path']})"
                                       if config.get("base_model_name_or_path") else "")
  file = os.path.join(adapter_dir, WEIGHTS)
  layouts = adapter_layouts(cfg)
  for lay in layouts:
    entry = ckpt.entries.get(lay.hf_name)
    if entry is None:
      raise HFModelError(f"{file}: tensor '{lay.hf_name}' is missing; model_dir must be {base}")
    if entry.shape != lay.hf_shape:
      raise HFModelError(f"{file}: tensor '{lay.hf_name}' has shape {list(entry.shape)} but model_dir's model "
                         f"implies {list(lay.hf_shape)}; model_dir must be {base}")
  unknown = sorted(set(ckpt.entries) - {lay.hf_name for lay in layouts})
  if unknown:
    raise HFModelError(f"{file}: tensor '{unknown[0]}' (and {len(unknown) - 1} more) has no place in model_dir's "
                       f"{cfg.n_layers}-layer model; model_dir must be {base}")
  adapters = read_tensors(ckpt, layouts, cfg, shardings, np.float32)
  ckpt.close()
  return adapters


def save_merged_hf(cfg, params: dict, out_dir: str, source_dir: str | None = None, dtype: str | None = None,
                   max_shard_bytes: int = 4 << 30):
  """Writes a LoRA model's params (base and adapters, as lora.merge gives them) as one full
  Hugging Face checkpoint, each adapter folded into its weight (W + (alpha / r) A B, in fp32, one
  tensor at a time): what transformers and vLLM load without peft. Else as hf.save_hf."""
  factors = {}  # the adapted weight's path -> its A and B layouts
  for lay in adapter_layouts(cfg):
    weight = lay.path[:-2] + (lay.path[-2].removesuffix(lora.SUFFIX),)
    factors.setdefault(weight, []).append(lay)

  def fold(lay, w):
    if lay.path not in factors:
      return w
    a, b = (param_of(cfg, params, f) for f in factors[lay.path])
    return lora.merged({"w": w, "w" + lora.SUFFIX: {"a": a, "b": b}}, cfg, np.float32)["w"]

  save_hf(cfg, params, out_dir, source_dir, dtype, max_shard_bytes, fold=fold)


def _open(adapter_dir: str) -> tuple:
  """(adapter_config.json contents, the adapter's tensors), after checking that the config asks
  for plain LoRA and that every tensor is a LoRA factor of a decoder projection."""
  path, file = os.path.join(adapter_dir, CONFIG), os.path.join(adapter_dir, WEIGHTS)
  if not os.path.isfile(path):
    raise HFModelError(f"{adapter_dir}: no {CONFIG}; a PEFT adapter directory holds {CONFIG} and {WEIGHTS} "
                       "(PeftModel.save_pretrained writes them)")
  try:
    with open(path) as f:
      config = json.load(f)
  except json.JSONDecodeError:
    raise HFModelError(f"{path} is not JSON; re-save the adapter with PeftModel.save_pretrained") from None
  if config.get("peft_type") != "LORA":
    raise HFModelError(f"{path}: peft_type={config.get('peft_type')!r}; only LORA adapters load into model.lora")
  for field, plain in PLAIN.items():
    if config.get(field) not in plain:
      raise HFModelError(f"{path}: {field}={config[field]!r} is more than plain LoRA on whole projections "
                         f"(model.lora needs {field}={plain[0]!r}); merge the adapter into its base with peft's "
                         "merge_and_unload() and use that as model_dir")
  if not isinstance(config.get("r"), int) or not isinstance(config.get("lora_alpha"), (int, float)):
    raise HFModelError(f"{path}: needs an integer 'r' and a number 'lora_alpha'; the file is incomplete")
  if not os.path.isfile(file):
    pickle = os.path.isfile(os.path.join(adapter_dir, "adapter_model.bin"))
    raise HFModelError(f"{adapter_dir}: no {WEIGHTS}; " +
                       ("it holds adapter_model.bin (a pickle): re-save it with PeftModel.save_pretrained(dir, "
                        "safe_serialization=True)" if pickle else "PeftModel.save_pretrained writes it"))
  ckpt = SafetensorsDir(adapter_dir, WEIGHTS)
  for name in ckpt.entries:
    m = TENSOR.fullmatch(name)
    if m is None or m.group(1) not in LORA_TARGETS:
      raise HFModelError(f"{file}: tensor '{name}' is not a LoRA factor of a decoder projection "
                         f"(model.layers.<i>.{{{', '.join(LORA_TARGETS)}}}); model.lora adapts only those")
  return config, ckpt


def _settings(config: dict, ckpt: SafetensorsDir) -> dict:
  """model.lora's fields for the adapter: r and alpha from its config, targets from its tensors."""
  r = config["r"]
  alpha = config["lora_alpha"] * (math.sqrt(r) if config.get("use_rslora") else 1.0)  # rsLoRA: alpha / sqrt(r)
  adapted = {TENSOR.fullmatch(name).group(1) for name in ckpt.entries}
  return dict(rank=r, alpha=float(alpha), dropout=float(config.get("lora_dropout") or 0.0),
              targets=tuple(name.split(".")[-1] for name in LORA_TARGETS if name in adapted))
