"""Hugging Face config.json <-> our model config, one entry per supported family.

Reading honours every config.json field that changes the model's math, fills what a file leaves
out with transformers' defaults for that family, and refuses what the decoder cannot do, naming
the file and field. Writing produces a config.json that reads back into the same model.
"""
import dataclasses
import json
import math
import os

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.config import DEFAULTS, ROPE_SCALING_KEYS, is_sliding, model_config


class HFModelError(UserError):
  """A Hugging Face model directory we cannot read as it is; names the file, field or tensor."""


@dataclasses.dataclass(frozen=True)
class Family:
  model_type: str
  architecture: str
  label: str
  head_dim: int = 0  # transformers' default when config.json has none; 0 = hidden_size // heads
  gemma: bool = False  # (1 + w) norms, post norms, sqrt(d) embeddings, tanh GELU, query_pre_attn_scalar
  qkv_bias: bool = False
  qk_norm: bool = False
  tie: bool = False
  window_every: int = 0  # default layer pattern: every n-th layer full, the others sliding
  softcaps: tuple = (None, None)  # default (attention, final) soft caps
  theta: float = 10000.0
  local_theta: float = 0.0  # RoPE base of sliding layers (Gemma 3)


FAMILIES = {
    f.model_type: f for f in (
        Family("llama", "LlamaForCausalLM", "Llama 3.x"),
        Family("qwen2", "Qwen2ForCausalLM", "Qwen2/2.5", qkv_bias=True),
        Family("qwen3", "Qwen3ForCausalLM", "Qwen3", head_dim=128, qk_norm=True),
        Family("gemma2", "Gemma2ForCausalLM", "Gemma 2", head_dim=256, gemma=True, tie=True, window_every=2, softcaps=(
            50.0, 30.0)),
        Family("gemma3_text", "Gemma3ForCausalLM", "Gemma 3 text", head_dim=256, gemma=True, qk_norm=True, tie=True,
               window_every=6, theta=1_000_000.0, local_theta=10000.0),
    )
}
SUPPORTED = ", ".join(f"{f.model_type} ({f.label})" for f in FAMILIES.values())
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu"
}
HF_ACTIVATION = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
# Fields of ours that only set precision; everything else must survive a trip through config.json.
PRECISION_FIELDS = ("dtype", "param_dtype")
# Fields of ours that only set how the program runs (not what it computes): config.json has none.
EXECUTION_FIELDS = ("scan_layers", "remat", "attention_block", "attention_kernel", "logprob_chunk")


def read_config(model_dir: str) -> dict:
  path = os.path.join(model_dir, "config.json")
  if not os.path.isfile(path):
    raise HFModelError(f"{model_dir}: no config.json; point at a Hugging Face model directory "
                       "(config.json + *.safetensors)")
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise HFModelError(f"{path}: not valid JSON ({e})") from None


def config_from_hf(hf: dict, where: str = "config.json", **overrides):
  """config.json contents -> our model config. overrides: our fields (e.g. dtype) that win."""
  model_type = hf.get("model_type")
  family = FAMILIES.get(model_type)
  if family is None:
    raise HFModelError(f"{where}: model_type {model_type!r} ({', '.join(hf.get('architectures') or [])}) is not "
                       f"supported; supported: {SUPPORTED}")

  def refuse(field, why):
    raise HFModelError(f"{where}: {field}={hf.get(field)!r} {why}; the {family.label} decoder here cannot honour it")

  for field in ("quantization_config", "use_bidirectional_attention", "mlp_bias"):
    if hf.get(field):
      refuse(field, "is set")
  if hf.get("attention_bias") and not family.qkv_bias:
    refuse("attention_bias", "adds an output-projection bias")
  act_key = "hidden_activation" if family.gemma and "hidden_activation" in hf else "hidden_act"
  act = hf.get(act_key, "gelu_pytorch_tanh" if family.gemma else "silu")
  if act not in ACTIVATIONS:
    raise HFModelError(f"{where}: {act_key}={act!r} is not supported; supported: {sorted(ACTIVATIONS)}")

  missing = [
      k for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
      if not isinstance(hf.get(k), int)
  ]
  if missing:
    raise HFModelError(f"{where}: needs integer {missing}; the file is incomplete")
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  n_layers = hf["num_hidden_layers"]
  window, layer_types = _attention_layout(hf, family, n_layers, where)
  theta, scaling, local_theta = _rope(hf, family, where)
  caps = [
      hf.get(k, default) for k, default in zip(("attn_logit_softcapping", "final_logit_softcapping"), family.softcaps)
  ]
  head_dim = hf.get("head_dim") or family.head_dim or d // heads
  fields = dict(vocab_size=hf["vocab_size"], d_model=d, n_layers=n_layers, n_heads=heads,
                n_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim, mlp_dim=hf["intermediate_size"],
                tie_embeddings=hf.get("tie_word_embeddings", family.tie), rope_theta=theta, rope_scaling=scaling,
                rope_local_theta=local_theta, norm_eps=hf.get("rms_norm_eps",
                                                              1e-6), qkv_bias=family.qkv_bias, qk_norm=family.qk_norm,
                max_seq_len=hf.get("max_position_embeddings",
                                   DEFAULTS["max_seq_len"]), mlp_activation=ACTIVATIONS[act], sliding_window=window,
                layer_types=layer_types, attn_logit_softcap=float(caps[0] or 0.0), final_logit_softcap=float(caps[1] or
                                                                                                             0.0))
  if family.gemma:
    fields.update(norm_style="gemma", post_norms=True, embed_scale=math.sqrt(d),
                  query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)))
  dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").replace("torch.", "")
  fields.update(dtype=dtype, param_dtype=dtype)
  fields.update(overrides)
  try:
    return model_config(**fields)
  except ValueError as e:
    raise HFModelError(f"{where}: {e}") from None


def _attention_layout(hf, family, n_layers, where):
  """-> (sliding_window, layer_types) in our terms."""
  if family.model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
    return 0, ()  # transformers ignores sliding_window unless use_sliding_window
  if not (family.window_every or family.model_type in ("qwen2", "qwen3")):
    return 0, ()
  window = hf.get("sliding_window", 4096)
  if not window:
    return 0, ()
  names = hf.get("layer_types")
  if names is None:
    if family.window_every:
      every = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or family.window_every
      names = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
    else:  # Qwen: layers from max_window_layers on slide
      first = hf.get("max_window_layers", 28)
      names = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
  bad = sorted(set(names) - set(HF_LAYER_TYPES))
  if bad or len(names) != n_layers:
    raise HFModelError(f"{where}: layer_types must list {sorted(HF_LAYER_TYPES)} once per layer "
                       f"({n_layers}); got unsupported {bad or names}")
  return int(window), tuple(HF_LAYER_TYPES[n] for n in names)


def _rope(hf, family, where):
  """-> (theta, scaling dict or None, local theta), from v5 rope_parameters or v4 rope_theta/rope_scaling."""
  params = hf.get("rope_parameters")
  if params is None:  # transformers 4.x files
    params = dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", family.theta))
    if family.local_theta:
      params = {
          "full_attention": params,
          "sliding_attention": {
              "rope_theta": hf.get("rope_local_base_freq", family.local_theta)
          }
      }
  if family.local_theta:
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    _check_rope(local, "rope_parameters.sliding_attention", where, allow_scaling=False)
    return (full.get("rope_theta", family.theta), _check_rope(full, "rope_parameters.full_attention",
                                                              where), float(local.get("rope_theta",
                                                                                      family.local_theta)))
  return params.get("rope_theta", family.theta), _check_rope(params, "rope_parameters", where), 0.0


def _check_rope(params, field, where, allow_scaling=True):
  kind = params.get("rope_type", params.get("type", "default"))
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise HFModelError(f"{where}: {field}.partial_rotary_factor={params['partial_rotary_factor']} is not "
                       "supported (RoPE on the whole head only)")
  if kind == "default":
    return None
  if kind not in ROPE_SCALING_KEYS or not allow_scaling:
    supported = ["default", *ROPE_SCALING_KEYS] if allow_scaling else ["default"]
    raise HFModelError(f"{where}: {field}.rope_type={kind!r} is not supported; supported: {supported}")
  missing = [k for k in ROPE_SCALING_KEYS[kind] if k not in params]
  if missing:
    raise HFModelError(f"{where}: {field} ({kind}) lacks {missing}")
  return dict(rope_type=kind, **{k: params[k] for k in ROPE_SCALING_KEYS[kind]})


def family_of(cfg) -> Family:
  """The Hugging Face family whose config.json can express this model config."""
  if cfg.norm_style == "gemma":
    return FAMILIES["gemma3_text" if cfg.qk_norm else "gemma2"]
  if cfg.qk_norm:
    return FAMILIES["qwen3"]
  return FAMILIES["qwen2" if cfg.qkv_bias else "llama"]


def hf_config(cfg, base: dict | None = None, dtype: str | None = None) -> dict:
  """Our model config -> config.json contents. base: the source model's config.json, whose other
  fields (token ids, generation defaults) are kept; dtype: the dtype of the exported weights."""
  family = family_of(cfg)
  legacy = ("rope_theta", "rope_scaling", "rope_local_base_freq", "torch_dtype", "sliding_window_pattern",
            "_sliding_window_pattern")
  out = {k: v for k, v in (base or {}).items() if k not in legacy}
  layer_types = ["sliding_attention" if is_sliding(cfg, i) else "full_attention" for i in range(cfg.n_layers)]
  scaling = dict(cfg.rope_scaling) if cfg.rope_scaling is not None else {"rope_type": "default"}
  rope = dict(scaling, rope_theta=cfg.rope_theta)
  if family.local_theta:
    rope = {
        "full_attention": rope,
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": cfg.rope_local_theta or cfg.rope_theta
        }
    }
  out.update(architectures=[family.architecture], model_type=family.model_type, vocab_size=cfg.vocab_size,
             hidden_size=cfg.d_model, intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.n_layers,
             num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
             max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
             rope_parameters=rope, dtype=dtype or cfg.param_dtype)
  out["hidden_activation" if family.gemma else "hidden_act"] = HF_ACTIVATION[cfg.mlp_activation]
  if family.gemma:
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    out.update(query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
               sliding_window=cfg.sliding_window or None, layer_types=layer_types,
               attn_logit_softcapping=cfg.attn_logit_softcap or None, final_logit_softcapping=cfg.final_logit_softcap or
               None)
  elif family.model_type in ("qwen2", "qwen3"):
    out.update(use_sliding_window=bool(cfg.sliding_window), sliding_window=cfg.sliding_window or None,
               layer_types=layer_types)
  if family.model_type != "qwen2":
    out["attention_bias"] = False
  _check_round_trip(cfg, config_from_hf(out, "exported config.json"), family)
  return out


def _semantics(cfg) -> dict:
  """What a config computes, with equivalent spellings (layer_types, per-layer RoPE) made equal."""
  skip = PRECISION_FIELDS + EXECUTION_FIELDS + ("layer_types", "sliding_window", "rope_theta", "rope_scaling",
                                                "rope_local_theta", "lora")  # adapters: adapter_config.json
  out = {k: cfg[k] for k in DEFAULTS if k not in skip}
  out["query_pre_attn_scalar"] = cfg.query_pre_attn_scalar or cfg.head_dim
  for i in range(cfg.n_layers):
    local = is_sliding(cfg, i) and cfg.rope_local_theta > 0
    scaling = None if local or cfg.rope_scaling is None else dict(cfg.rope_scaling)
    out[f"layer {i}"] = (cfg.sliding_window if is_sliding(cfg, i) else 0,
                         cfg.rope_local_theta if local else cfg.rope_theta, scaling)
  return out


def _check_round_trip(cfg, back, family):
  want, got = _semantics(cfg), _semantics(back)
  for key in want:
    if want[key] != got[key]:
      raise HFModelError(f"model config {key}={want[key]!r} has no {family.label} ({family.model_type}) "
                         f"config.json equivalent (it would read back as {got[key]!r})")
