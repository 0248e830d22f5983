"""Model shape configs: one ConfigDict per decoder, read by the model, engine and planner.

The family fields (after `max_seq_len`) cover Llama 3, Qwen2/2.5, Qwen3 and Gemma 2/3; their
defaults are the plain Llama-style decoder. models/families.py maps HF config.json onto them.
"""
import fnmatch

import ml_collections

DEFAULTS = dict(
    vocab_size=32000,
    d_model=512,
    n_layers=4,
    n_heads=8,
    n_kv_heads=8,
    head_dim=64,
    mlp_dim=1536,
    tie_embeddings=False,
    rope_theta=10000.0,
    norm_eps=1e-6,
    qkv_bias=False,
    dtype="float32",  # activations / compute
    param_dtype="float32",  # stored weights
    max_seq_len=4096,
    qk_norm=False,  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    norm_style="rms",  # "rms": x * w (Llama, Qwen); "gemma": x * (1 + w), w stored as HF stores it
    post_norms=False,  # Gemma 2/3: norms on the attention and MLP outputs before each residual add
    mlp_activation="silu",  # gate activation: "silu" | "gelu_tanh" | "gelu"
    embed_scale=1.0,  # embeddings times this, rounded to param_dtype (Gemma: sqrt(d_model))
    query_pre_attn_scalar=0.0,  # attention scores times its ** -0.5; 0 = head_dim
    attn_logit_softcap=0.0,  # cap * tanh(score / cap) on attention scores; 0 = off (Gemma 2)
    final_logit_softcap=0.0,  # the same on the output logits; 0 = off (Gemma 2)
    sliding_window=0,  # "sliding" layers see keys fewer than this many positions back; 0 = none
    layer_types=(),  # per layer "full" | "sliding"; () = every layer sliding if sliding_window else full
    rope_scaling=None,  # {"rope_type": "linear" | "llama3", "factor": ..., ...} as in HF config.json
    rope_local_theta=0.0,  # Gemma 3: RoPE base of sliding layers, which skip rope_scaling; 0 = as full layers
    # Layer params stacked [n_layers, ...] (logical axis "layers") and applied by one scan, so the
    # compiled program does not grow with depth; the KV cache is then one (keys, values) pair
    # stacked the same way. False: a list of layers, unrolled (checkpoints keep "layers/<i>/...").
    # "auto" (the run config's default): scanned from SCAN_DEEPER_THAN + 1 layers.
    scan_layers=False,
    # Activation rematerialisation per layer under differentiation, trading compute for memory:
    # "none" keeps every activation the backward pass needs; "full" keeps only each layer's input
    # and recomputes the rest; "dots" keeps the outputs of matmuls without batch dimensions (the
    # projections and MLP) and recomputes the elementwise work and attention between them. With
    # unrolled layers XLA may schedule the recomputation early and keep it all (XLA:CPU does: 8
    # layers saved 8%); under scan_layers one layer is recomputed at a time (8 layers: 7x less).
    remat="none",
    # Blockwise attention (masks given as models.attention.Segments: the trainer's rows) works on
    # tiles of this many queries by this many keys, so its memory is linear in the sequence length.
    attention_block=512,
    # Who computes that attention where queries attend their own row's tokens (the trainer's rows, a
    # prompt's prefill): "auto" the kernel JAX ships for the platform (Pallas: Triton on GPU, Mosaic on
    # TPU) where it computes the same, the portable blockwise path elsewhere and on CPU; "portable"
    # always the portable path; "pallas" the kernels wherever they apply, on CPU interpreted (tests).
    attention_kernel="auto",
    # The trainer runs the output head over chunks of this many positions (rl.layout), so it holds
    # fp32 logits [rows, logprob_chunk, vocab], never a micro-batch's [rows, length, vocab].
    logprob_chunk=256,
    # Low-rank adapters (models/lora.py): rank 0 = full fine-tuning. With rank r the targeted
    # projections compute x W + (alpha / r) dropout(x) A B with A [in, r], B [r, out] (B starts at
    # zero), the base W frozen; only A and B are trained, checkpointed and synced. targets: PEFT
    # module names or fnmatch patterns over them (models.lora.TARGETS: self_attn.q_proj, ...,
    # mlp.down_proj; "q_proj" matches the first).
    lora=dict(rank=0, alpha=16.0, dropout=0.0,
              targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
)
CHOICES = {
    "norm_style": ("rms", "gemma"),
    "mlp_activation": ("silu", "gelu_tanh", "gelu"),
    "remat": ("none", "full", "dots"),
    "attention_kernel": ("auto", "portable", "pallas"),
}
LAYER_TYPES = ("full", "sliding")
# The projections LoRA may adapt: PEFT module name (as in HF checkpoints, under model.layers.<i>.) ->
# (the Block's sub-module, the weight, how many leading dims of the weight are its input).
LORA_TARGETS = {
    "self_attn.q_proj": ("attn", "wq", 1),
    "self_attn.k_proj": ("attn", "wk", 1),
    "self_attn.v_proj": ("attn", "wv", 1),
    "self_attn.o_proj": ("attn", "wo", 2),
    "mlp.gate_proj": ("mlp", "gate", 1),
    "mlp.up_proj": ("mlp", "up", 1),
    "mlp.down_proj": ("mlp", "down", 1),
}
# A run config may leave model.dtype and model.scan_layers to the run ("auto"): chosen once as it starts
# (runtime.resolve_auto), from the platform and the model's depth.
AUTO = "auto"
AUTO_FIELDS = ("dtype", "scan_layers")
SCAN_DEEPER_THAN = 8  # layers: an unrolled program grows, and compiles longer, with every layer


def auto_dtype(platform: str) -> str:
  """Compute in float32 on CPU, where bfloat16 is slower; in bfloat16 on accelerators."""
  return "float32" if platform == "cpu" else "bfloat16"


def auto_scan_layers(n_layers: int) -> bool:
  return n_layers > SCAN_DEEPER_THAN


ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
}


def model_config(**overrides) -> ml_collections.ConfigDict:
  unknown = set(overrides) - set(DEFAULTS)
  if unknown:
    raise ValueError(f"model config: unknown field(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
  fields = dict(DEFAULTS, **overrides)
  if fields["dtype"] == AUTO:
    raise ValueError("model config: dtype='auto' is chosen by a run as it starts (from its platform); "
                     "pass float32 or bfloat16")
  if fields["scan_layers"] == AUTO:  # the depth alone decides; a run prints what it chose
    fields["scan_layers"] = auto_scan_layers(fields["n_layers"])
  if not isinstance(fields["scan_layers"], bool):
    raise ValueError(f"model config: scan_layers={fields['scan_layers']!r}; use True, False or 'auto' (scan from "
                     f"{SCAN_DEEPER_THAN + 1} layers)")
  cfg = ml_collections.ConfigDict(fields)
  cfg.lora = ml_collections.ConfigDict(dict(DEFAULTS["lora"], **cfg.lora))  # a partial lora dict keeps the defaults
  cfg.lora.targets = tuple(cfg.lora.targets)
  if cfg.n_heads % cfg.n_kv_heads:
    raise ValueError(f"model config: n_heads={cfg.n_heads} must be a multiple of n_kv_heads={cfg.n_kv_heads}")
  for field, allowed in CHOICES.items():
    if cfg[field] not in allowed:
      raise ValueError(f"model config: {field}={cfg[field]!r}; use one of {allowed}")
  for field in ("attention_block", "logprob_chunk"):
    if cfg[field] < 1:
      raise ValueError(f"model config: {field}={cfg[field]} must be >= 1 (default {DEFAULTS[field]})")
  cfg.layer_types = tuple(cfg.layer_types)
  if cfg.layer_types and (len(cfg.layer_types) != cfg.n_layers or set(cfg.layer_types) - set(LAYER_TYPES)):
    raise ValueError(f"model config: layer_types={cfg.layer_types} must name {LAYER_TYPES} once per layer "
                     f"({cfg.n_layers} layers), or be () for all alike")
  if cfg.rope_scaling is not None:
    kind = cfg.rope_scaling.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
      raise ValueError(f"model config: rope_scaling.rope_type={kind!r}; supported: {sorted(ROPE_SCALING_KEYS)}")
    missing = [k for k in ROPE_SCALING_KEYS[kind] if k not in cfg.rope_scaling]
    if missing:
      raise ValueError(f"model config: rope_scaling ({kind}) lacks {missing}")
  check_lora(cfg)
  return cfg


def lora_targets(cfg) -> tuple:
  """The PEFT names of the projections cfg.lora adapts (none at rank 0)."""
  if not cfg.lora.rank:
    return ()
  return tuple(name for name in LORA_TARGETS if any(_matches(name, p) for p in cfg.lora.targets))


def _matches(name: str, pattern: str) -> bool:
  return fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(name.split(".")[-1], pattern)


def lora_weight_dims(cfg) -> dict:
  """PEFT name -> (input size, output size) of each projection, as a matrix."""
  d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
  return {
      "self_attn.q_proj": (d, h * hd),
      "self_attn.k_proj": (d, kv * hd),
      "self_attn.v_proj": (d, kv * hd),
      "self_attn.o_proj": (h * hd, d),
      "mlp.gate_proj": (d, f),
      "mlp.up_proj": (d, f),
      "mlp.down_proj": (f, d)
  }


def check_lora(cfg):
  lora = cfg.lora
  if lora.rank < 0:
    raise ValueError(f"model.lora.rank={lora.rank} must be >= 0 (0 = full fine-tuning, e.g. 16 for adapters)")
  if not lora.rank:
    return
  if not 0 <= lora.dropout < 1:
    raise ValueError(f"model.lora.dropout={lora.dropout} must be in [0, 1) (0 = off)")
  if lora.alpha <= 0:
    raise ValueError(f"model.lora.alpha={lora.alpha} must be > 0 (the adapters' scale is alpha / rank; e.g. 2 x rank)")
  names = ", ".join(LORA_TARGETS)
  unmatched = [p for p in lora.targets if not any(_matches(name, p) for name in LORA_TARGETS)]
  if unmatched or not lora.targets:
    raise ValueError(f"model.lora.targets: {list(unmatched) or '()'} match(es) no layer; name projections or fnmatch "
                     f"patterns over them: {names} (the part after the dot alone also matches, e.g. q_proj, *_proj)")
  dims = {n: min(io) for n, io in lora_weight_dims(cfg).items() if n in lora_targets(cfg)}
  smallest = min(dims, key=dims.get)
  if lora.rank > dims[smallest]:
    raise ValueError(f"model.lora.rank={lora.rank} is larger than {smallest}'s dimension {dims[smallest]} (a low-rank "
                     f"adapter needs rank <= min(in, out)); use --config.model.lora.rank={dims[smallest]} or less")


def is_sliding(cfg, layer: int) -> bool:
  return bool(cfg.sliding_window) and (not cfg.layer_types or cfg.layer_types[layer] == "sliding")


def param_count(cfg) -> int:
  """Exact parameter count of models.decoder.Decoder for this config."""
  d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
  attn = d * h * hd + 2 * d * kv * hd + h * hd * d
  if cfg.qkv_bias:
    attn += (h + 2 * kv) * hd
  if cfg.qk_norm:
    attn += 2 * hd
  norms = (4 if cfg.post_norms else 2) * d  # RMSNorm scales around attention and MLP
  layer = attn + 3 * d * f + norms  # q/k/v/o, gate/up/down, norms
  embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
  return cfg.n_layers * layer + embed + d  # final norm


def kv_bytes_per_token(cfg, bytes_per_value: int = 2) -> int:
  """KV-cache bytes one token occupies across all layers."""
  return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_value
