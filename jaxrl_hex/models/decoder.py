"""One decoder in Flax NNX for the Llama, Qwen and Gemma families: RMSNorm, RoPE (with Llama 3 /
linear scaling), grouped-query attention (optional QKV bias, QK-norm, soft-capping, sliding
windows), gated MLP. models/config.py names the switches; the defaults are Llama.

Every parameter carries `axes`, a tuple of logical axis names; meshes.Pool maps them onto a
mesh through a rules table, so the model never names a mesh axis.

One call serves training, prefill and decode: `mask[b, t, s]` says which keys query t may see,
and with a KV cache the new keys are written at `cache_index` before attending. Sliding-window
layers also need each key's position: without a cache the keys are the queries; with one, pass
`key_positions` [B, S], or the cache is taken to hold each row's tokens in consecutive slots of a
line or a ring (the engines' layouts), where slot distance modulo the cache length is position
distance.

Numerics follow transformers' eager implementations (fp32 norms, RoPE tables and softmax), so a
converted checkpoint gives the same logits.
"""
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jaxrl_hex.models.config import is_sliding

Cache = list  # per layer: (k, v), each [batch, cache_len, kv_heads, head_dim]

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False)
}


def _param(rngs, shape, axes, dtype, scale):
  return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * scale, axes=axes)


def softcap(x, cap):
  return x if not cap else jnp.tanh(x / cap) * cap


class RMSNorm(nnx.Module):

  def __init__(self, dim, eps, dtype, style="rms", axes=("norm",)):
    self.gemma = style == "gemma"  # Gemma stores w for x * (1 + w), so a fresh norm holds zeros
    self.scale = nnx.Param((jnp.zeros if self.gemma else jnp.ones)((dim,), dtype), axes=axes)
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.gemma:  # weight applied in fp32, then cast (Gemma); Llama casts first, then weights
      return (x32 * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
    return x32.astype(x.dtype) * self.scale[...].astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
  """Inverse frequencies [head_dim // 2] in fp32, as transformers computes them for rope_type
  default, linear and llama3."""
  inv = (1.0 / (theta**(np.arange(0, head_dim, 2).astype(np.float32) / head_dim))).astype(np.float32)
  if scaling is None:
    return inv
  factor = np.float32(scaling["factor"])
  if scaling["rope_type"] == "linear":
    return inv / factor
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]  # llama3
  old_len = scaling["original_max_position_embeddings"]
  wavelen = np.float32(2 * math.pi) / inv
  scaled = np.where(wavelen > old_len / low, inv / factor, inv)
  smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_settings(cfg, sliding: bool) -> tuple:
  """(head_dim, theta, scaling) of a layer's RoPE."""
  if sliding and cfg.rope_local_theta > 0:  # Gemma 3: sliding layers keep their own, unscaled RoPE
    return cfg.head_dim, cfg.rope_local_theta, None
  return cfg.head_dim, cfg.rope_theta, cfg.rope_scaling


def rope_table(positions, head_dim, theta, scaling=None):
  """positions [B, T] -> (cos, sin), each [B, T, 1, head_dim // 2] fp32."""
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(rope_frequencies(head_dim, theta, scaling))
  return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rope_tables(cfg, limit: int) -> dict:
  """Every layer setting's rope_table for positions 0..limit-1, for Decoder(rope_tables=...).

  A decode loop makes these once, outside the loop, and each step looks its positions up:
  computed inside a step, XLA fuses cos and sin into every consumer and evaluates them per
  element (per layer, head and cache write: ~5% of a small model's decode step on CPU)."""
  return {args: rope_table(jnp.arange(limit)[None], *args) for args in layer_rope_settings(cfg)}


def layer_rope_settings(cfg) -> set:
  """The distinct rope_settings of the model's layers (one, or local and global for Gemma 3)."""
  cfg = ml_collections.FrozenConfigDict(cfg)  # rope_scaling as a hashable key, as the layers hold it
  return {rope_settings(cfg, is_sliding(cfg, i)) for i in range(cfg.n_layers)}


def rope(x, table):
  """Rotate-half RoPE (the Hugging Face convention). x [B, T, H, D], table from rope_table."""
  cos, sin = table
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg, rngs, sliding=False):
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    self.wq = _param(rngs, (d, h, hd), ("qkv_embed", "heads", "head_dim"), pdt, d**-0.5)
    self.wk = _param(rngs, (d, kv, hd), ("qkv_embed", "kv_heads", "head_dim"), pdt, d**-0.5)
    self.wv = _param(rngs, (d, kv, hd), ("qkv_embed", "kv_heads", "head_dim"), pdt, d**-0.5)
    self.wo = _param(rngs, (h, hd, d), ("heads", "head_dim", "o_embed"), pdt, (h * hd)**-0.5)
    if cfg.qkv_bias:
      self.bq = nnx.Param(jnp.zeros((h, hd), pdt), axes=("heads", "head_dim"))
      self.bk = nnx.Param(jnp.zeros((kv, hd), pdt), axes=("kv_heads", "head_dim"))
      self.bv = nnx.Param(jnp.zeros((kv, hd), pdt), axes=("kv_heads", "head_dim"))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg.norm_eps, pdt, cfg.norm_style, axes=("head_dim",))
      self.k_norm = RMSNorm(hd, cfg.norm_eps, pdt, cfg.norm_style, axes=("head_dim",))
    self.qkv_bias, self.qk_norm = cfg.qkv_bias, cfg.qk_norm
    self.rope_args = rope_settings(cfg, sliding)
    self.scale = (cfg.query_pre_attn_scalar or hd)**-0.5
    self.logit_cap = cfg.attn_logit_softcap
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x, rope_tables, mask, cache, cache_index):
    """rope_tables: rope_args -> rope_table(positions, *rope_args), shared by all layers."""
    dt = self.dtype
    x2 = x.reshape(-1, x.shape[-1])  # [tokens, d_model]: see MLP
    proj = lambda w: (x2 @ w[...].astype(dt).reshape(w.shape[0], -1)).reshape(x.shape[:2] + w.shape[1:])
    q, k, v = proj(self.wq), proj(self.wk), proj(self.wv)
    if self.qkv_bias:
      q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    table = rope_tables[self.rope_args]
    q, k = rope(q, table), rope(k, table)
    keys, values = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # the cache layout (init_cache)
    if cache is not None:
      keys = jax.lax.dynamic_update_slice_in_dim(cache[0], keys.astype(cache[0].dtype), cache_index, axis=3)
      values = jax.lax.dynamic_update_slice_in_dim(cache[1], values.astype(cache[1].dtype), cache_index, axis=2)
      cache = (keys, values)
    b, t, h, hd = q.shape
    kv = k.shape[2]
    g = h // kv
    # plain batched matmuls in the order XLA:CPU runs fast: [B, KV, G*T, hd] @ [B, KV, hd, S]
    q = q.reshape(b, t, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, hd)
    scores = jnp.matmul(q, keys.astype(dt)).astype(jnp.float32).reshape(b, kv, g, t, -1) * self.scale
    scores = softcap(scores, self.logit_cap)
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt).reshape(b, kv, g * t, -1)
    out = jnp.matmul(probs, values.astype(dt)).reshape(b, kv, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd)
    wo = self.wo[...].astype(dt)  # [heads, head_dim, d_model]
    return (out.reshape(b * t, -1) @ wo.reshape(-1, wo.shape[-1])).reshape(b, t, -1), cache


class MLP(nnx.Module):

  def __init__(self, cfg, rngs):
    d, f, pdt = cfg.d_model, cfg.mlp_dim, jnp.dtype(cfg.param_dtype)
    self.gate = _param(rngs, (d, f), ("mlp_up_embed", "mlp"), pdt, d**-0.5)
    self.up = _param(rngs, (d, f), ("mlp_up_embed", "mlp"), pdt, d**-0.5)
    self.down = _param(rngs, (f, d), ("mlp", "mlp_down_embed"), pdt, f**-0.5)
    self.activation = cfg.mlp_activation
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x):
    """x [..., d_model], taken as one [tokens, d_model] matrix: with the batch and time axes kept
    apart, XLA:CPU transposed the activation gradient in a slow fused loop (2x the MLP's backward)."""
    dt = self.dtype
    x2 = x.reshape(-1, x.shape[-1])
    h = ACTIVATIONS[self.activation](x2 @ self.gate[...].astype(dt)) * (x2 @ self.up[...].astype(dt))
    return (h @ self.down[...].astype(dt)).reshape(x.shape)


class Block(nnx.Module):

  def __init__(self, cfg, rngs, sliding=False):
    norm = lambda: RMSNorm(cfg.d_model, cfg.norm_eps, jnp.dtype(cfg.param_dtype), cfg.norm_style)
    self.attn_norm = norm()
    self.attn = Attention(cfg, rngs, sliding)
    self.mlp_norm = norm()
    self.mlp = MLP(cfg, rngs)
    if cfg.post_norms:
      self.post_attn_norm, self.post_mlp_norm = norm(), norm()
    self.post_norms, self.sliding = cfg.post_norms, sliding

  def __call__(self, x, rope_tables, mask, cache, cache_index):
    a, cache = self.attn(self.attn_norm(x), rope_tables, mask, cache, cache_index)
    x = x + (self.post_attn_norm(a) if self.post_norms else a)
    m = self.mlp(self.mlp_norm(x))
    return x + (self.post_mlp_norm(m) if self.post_norms else m), cache


class Decoder(nnx.Module):

  def __init__(self, cfg, rngs: nnx.Rngs):
    cfg = ml_collections.FrozenConfigDict(cfg)  # hashable, so the module's graphdef can key a jit cache
    pdt = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab_in", "embed_in"), pdt, cfg.d_model**-0.5)
    self.layers = nnx.List([Block(cfg, rngs, is_sliding(cfg, i)) for i in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt, cfg.norm_style)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed_out", "vocab_out"), pdt, cfg.d_model**-0.5)

  def __call__(self, tokens, positions, mask, cache: Cache | None = None, cache_index=0, key_positions=None,
               rope_tables=None):
    """tokens, positions [B, T]; mask [B, T, S] -> logits [B, T, vocab] (fp32), new cache.
    rope_tables: from rope_tables(cfg, limit) when every position is below limit (decode loops)."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    x = self.embed[...].astype(dt)[tokens]
    if cfg.embed_scale != 1.0:  # transformers rounds the scale to the weights' dtype
      x = x * jnp.asarray(np.float32(cfg.embed_scale).astype(cfg.param_dtype), dt)
    local_mask = window_mask(mask, positions, cfg.sliding_window, cache is not None, cache_index,
                             key_positions) if cfg.sliding_window else None
    if rope_tables is None:
      tables = {args: rope_table(positions, *args) for args in layer_rope_settings(cfg)}
    else:  # tables over 0..limit-1: look the positions up
      tables = {args: (cos[0, positions], sin[0, positions]) for args, (cos, sin) in rope_tables.items()}
    new_cache = []
    for i, layer in enumerate(self.layers):
      x, c = layer(x, tables, local_mask if layer.sliding else mask, None if cache is None else cache[i], cache_index)
      new_cache.append(c)
    x = self.final_norm(x)
    head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
    logits = softcap((x @ head.astype(dt)).astype(jnp.float32), cfg.final_logit_softcap)
    return logits, (new_cache if cache is not None else None)


def window_mask(mask, positions, window, cached, cache_index, key_positions=None):
  """mask [B, T, S] narrowed to keys fewer than `window` positions before each query."""
  if key_positions is not None or not cached:
    keys = positions if key_positions is None else key_positions  # no cache: the keys are the queries
    distance = positions[:, :, None] - keys[:, None, :]
  else:  # each row's tokens sit in consecutive slots of a line or ring: slot distance mod S = position distance
    t, s = mask.shape[1], mask.shape[2]
    distance = ((cache_index + jnp.arange(t))[:, None] - jnp.arange(s)[None, :]) % s
  return mask & (distance < window)


def causal_mask(valid):
  """valid [B, T] (False on padding) -> [B, T, T]: query t sees valid keys s <= t."""
  t = valid.shape[1]
  return jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]


# Per layer, keys [B, KV, head_dim, S] and values [B, KV, S, head_dim]: a decode step's q.k and
# p.v are then plain matmuls over the cache as it lies (a [B, S, KV, head_dim] cache is
# transposed whole at every step on CPU: 2x slower decode attention).
CACHE_AXES = (("batch", "kv_heads", "head_dim", "length"), ("batch", "kv_heads", "length", "head_dim"))
CACHE_LENGTH_AXES = (3, 2)


def cache_shapes(cfg, batch, length):
  sizes = {"batch": batch, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "length": length}
  return tuple(tuple(sizes[a] for a in axes) for axes in CACHE_AXES)


def init_cache(cfg, batch, length, dtype=None):
  dt = jnp.dtype(dtype or cfg.dtype)
  return [tuple(jnp.zeros(shape, dt) for shape in cache_shapes(cfg, batch, length)) for _ in range(cfg.n_layers)]


def extend_cache(cache, rows, extra: int):
  """The cache's rows[i] as row i, with `extra` empty positions after the cached ones."""

  def grow(x, axis):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x[rows], pad)

  return [tuple(grow(x, axis) for x, axis in zip(layer, CACHE_LENGTH_AXES)) for layer in cache]
