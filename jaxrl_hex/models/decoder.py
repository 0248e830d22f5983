"""A Llama/Qwen-family decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Every parameter carries `axes`, a tuple of logical axis names; meshes.Pool maps them onto a
mesh through a rules table, so the model never names a mesh axis.

One call serves training, prefill and decode: `mask[b, t, s]` says which keys query t may see,
and with a KV cache the new keys are written at `cache_index` before attending.
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

Cache = list  # per layer: (k, v), each [batch, cache_len, kv_heads, head_dim]


def _param(rngs, shape, axes, dtype, scale):
  return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * scale, axes=axes)


class RMSNorm(nnx.Module):

  def __init__(self, dim, eps, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=("norm",))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta):
  """Rotate-half RoPE (the Hugging Face convention). x [B, T, H, D], positions [B, T]."""
  half = x.shape[-1] // 2
  freqs = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles = positions[..., None].astype(jnp.float32) * freqs  # [B, T, half]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg, rngs):
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    self.wq = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), pdt, d ** -0.5)
    self.wk = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pdt, d ** -0.5)
    self.wv = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pdt, d ** -0.5)
    self.wo = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), pdt, (h * hd) ** -0.5)
    if cfg.qkv_bias:
      self.bq = nnx.Param(jnp.zeros((h, hd), pdt), axes=("heads", "head_dim"))
      self.bk = nnx.Param(jnp.zeros((kv, hd), pdt), axes=("kv_heads", "head_dim"))
      self.bv = nnx.Param(jnp.zeros((kv, hd), pdt), axes=("kv_heads", "head_dim"))
    self.qkv_bias = cfg.qkv_bias
    self.theta = cfg.rope_theta
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x, positions, mask, cache, cache_index):
    dt = self.dtype
    q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dt))
    k = jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(dt))
    v = jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(dt))
    if self.qkv_bias:
      q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
    q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
    if cache is not None:
      k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), cache_index, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), cache_index, axis=1)
      cache = (k, v)
    b, t, h, hd = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k.astype(dt)).astype(jnp.float32) / math.sqrt(hd)
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(dt)).reshape(b, t, h, hd)
    return jnp.einsum("bthk,hkd->btd", out, self.wo[...].astype(dt)), cache


class MLP(nnx.Module):

  def __init__(self, cfg, rngs):
    d, f, pdt = cfg.d_model, cfg.mlp_dim, jnp.dtype(cfg.param_dtype)
    self.gate = _param(rngs, (d, f), ("embed", "mlp"), pdt, d ** -0.5)
    self.up = _param(rngs, (d, f), ("embed", "mlp"), pdt, d ** -0.5)
    self.down = _param(rngs, (f, d), ("mlp", "embed"), pdt, f ** -0.5)
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x):
    dt = self.dtype
    h = jax.nn.silu(x @ self.gate[...].astype(dt)) * (x @ self.up[...].astype(dt))
    return h @ self.down[...].astype(dt)


class Block(nnx.Module):

  def __init__(self, cfg, rngs):
    pdt = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, mask, cache, cache_index):
    a, cache = self.attn(self.attn_norm(x), positions, mask, cache, cache_index)
    x = x + a
    return x + self.mlp(self.mlp_norm(x)), cache


class Decoder(nnx.Module):

  def __init__(self, cfg, rngs: nnx.Rngs):
    pdt = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pdt, cfg.d_model ** -0.5)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt,
                            cfg.d_model ** -0.5)

  def __call__(self, tokens, positions, mask, cache: Cache | None = None, cache_index=0):
    """tokens, positions [B, T]; mask [B, T, S] -> logits [B, T, vocab] (fp32), new cache."""
    dt = jnp.dtype(self.cfg.dtype)
    x = self.embed[...].astype(dt)[tokens]
    new_cache = []
    for i, layer in enumerate(self.layers):
      x, c = layer(x, positions, mask, None if cache is None else cache[i], cache_index)
      new_cache.append(c)
    x = self.final_norm(x)
    head = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
    logits = (x @ head.astype(dt)).astype(jnp.float32)
    return logits, (new_cache if cache is not None else None)


def causal_mask(valid):
  """valid [B, T] (False on padding) -> [B, T, T]: query t sees valid keys s <= t."""
  t = valid.shape[1]
  return jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]


def init_cache(cfg, batch, length, dtype=None):
  shape = (batch, length, cfg.n_kv_heads, cfg.head_dim)
  dt = jnp.dtype(dtype or cfg.dtype)
  return [(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.n_layers)]
