"""Model shape configs: one ConfigDict per decoder, read by the model, engine and planner."""
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
    dtype="float32",        # activations / compute
    param_dtype="float32",  # stored weights
    max_seq_len=4096,
)


def model_config(**overrides) -> ml_collections.ConfigDict:
  unknown = set(overrides) - set(DEFAULTS)
  if unknown:
    raise ValueError(f"model config: unknown field(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
  cfg = ml_collections.ConfigDict(dict(DEFAULTS, **overrides))
  if cfg.n_heads % cfg.n_kv_heads:
    raise ValueError(f"model config: n_heads={cfg.n_heads} must be a multiple of n_kv_heads={cfg.n_kv_heads}")
  return cfg


def param_count(cfg) -> int:
  """Exact parameter count of models.decoder.Decoder for this config."""
  d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
  attn = d * h * hd + 2 * d * kv * hd + h * hd * d
  if cfg.qkv_bias:
    attn += (h + 2 * kv) * hd
  layer = attn + 3 * d * f + 2 * d  # q/k/v/o, gate/up/down, two RMSNorm scales
  embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
  return cfg.n_layers * layer + embed + d  # final norm


def kv_bytes_per_token(cfg, bytes_per_value: int = 2) -> int:
  """KV-cache bytes one token occupies across all layers."""
  return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_value
