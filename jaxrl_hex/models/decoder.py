"""One decoder in Flax NNX for the Llama, Qwen and Gemma families: RMSNorm, RoPE (with Llama 3 /
linear scaling), grouped-query attention (optional QKV bias, QK-norm, soft-capping, sliding
windows), gated MLP. models/config.py names the switches; the defaults are Llama.

Every parameter carries `axes`, a tuple of logical axis names; meshes.Pool maps them onto a
mesh through a rules table, so the model never names a mesh axis.

One call serves training, prefill and decode: `mask[b, t, s]` says which keys query t may see,
and with a KV cache the new keys are written at `cache_index` before attending. A mask given as
models.attention.Segments (per-token segment ids and positions) instead runs blockwise attention,
which holds neither the [B, T, S] mask nor the [B, H, T, S] scores: the trainer's long rows. Sliding-window
layers also need each key's position: without a cache the keys are the queries; with one, pass
`key_positions` [B, S], or the cache is taken to hold each row's tokens in consecutive slots of a
line or a ring (the engines' layouts), where slot distance modulo the cache length is position
distance.

Numerics follow transformers' eager implementations (fp32 norms, RoPE tables and softmax), so a
converted checkpoint gives the same logits.

With cfg.scan_layers the layers are one Block whose params lead with a "layers" axis [L, ...]
(made by nnx.vmap) and are applied by one jax.lax.scan, so the program's size does not depend on
the depth; stack_layers / unstack_layers convert params between the two layouts. cfg.remat wraps
each layer's application in jax.checkpoint.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jaxrl_hex.models import kernels, lora
from jaxrl_hex.models.attention import Segments
from jaxrl_hex.models.config import is_sliding
from jaxrl_hex.models.sharding import constrain

# A list of (keys, values) in the layout of CACHE_AXES (or FLAT_CACHE_AXES): one pair per layer,
# or with cfg.scan_layers one pair for all layers, stacked [L, ...] (see cache_axes).
Cache = list

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
    lora.attach(self, {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj"
    }, cfg, rngs)
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
    self.block, self.kernel = cfg.attention_block, cfg.attention_kernel
    # A layer that may slide: scanned layers learn their window only as the scan runs.
    self.windowed = sliding or (cfg.scan_layers and any(is_sliding(cfg, i) for i in range(cfg.n_layers)))
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x, table, mask, cache, cache_index, key=None):
    """table: rope_table(positions, *rope_args) of this layer's RoPE settings; key: the adapters'
    dropout (models.lora), None outside training."""
    dt = self.dtype
    x2 = x.reshape(-1, x.shape[-1])  # [tokens, d_model]: see MLP
    drops = [None] * 4 if key is None else list(jax.random.split(key, 4))  # each adapter's dropout key
    proj = lambda name, d: lora.project(self, name, x2, dt, d).reshape(x.shape[:2] + getattr(self, name).shape[1:])
    q, k, v = proj("wq", drops[0]), proj("wk", drops[1]), proj("wv", drops[2])
    if self.qkv_bias:
      q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rope(q, table), rope(k, table)
    b, t, h, hd = q.shape
    kv = k.shape[2]
    keys, values = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # the cache layout (init_cache)
    if isinstance(cache_index, (PagedIndex, LayerColumn, PrefixKV)):
      keys, values, cache = cache_index.write_read(cache, keys, values)
    elif cache is not None:  # the length axis is last of keys, next to last of values, in either layout
      keys, values = fold_heads(keys, values, cache)
      cache = (jax.lax.dynamic_update_slice_in_dim(cache[0], keys.astype(cache[0].dtype), cache_index, axis=-1),
               jax.lax.dynamic_update_slice_in_dim(cache[1], values.astype(cache[1].dtype), cache_index, axis=-2))
      keys, values = unfold_heads(*cache, kv)
    g = h // kv
    q = q.reshape(b, t, kv, g, hd).transpose(0, 2, 3, 1, 4)  # [B, KV, G, T, hd]
    if isinstance(mask, Segments):
      out = kernels.attention(q, keys.astype(dt), values.astype(dt), mask, self.scale, self.logit_cap, self.block,
                              self.kernel, self.windowed)
    else:  # plain batched matmuls in the order XLA:CPU runs fast: [B, KV, G*T, hd] @ [B, KV, hd, S]
      # scores and sums in fp32, as the blockwise path has them: the engine's decode steps then
      # round where the trainer's forward rounds
      f32 = jnp.float32
      scores = jnp.matmul(q.reshape(b, kv, g * t, hd), keys.astype(dt), preferred_element_type=f32)
      scores = softcap(scores.reshape(b, kv, g, t, -1) * self.scale, self.logit_cap)
      scores = jnp.where(mask[:, None, None], scores, -1e30)
      probs = jax.nn.softmax(scores, axis=-1).astype(dt).reshape(b, kv, g * t, -1)
      out = jnp.matmul(probs, values.astype(dt), preferred_element_type=f32).astype(dt).reshape(b, kv, g, t, hd)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b * t, h * hd)  # wo: [heads, head_dim, d_model]
    return lora.project(self, "wo", out, dt, drops[3]).reshape(b, t, -1), cache


class MLP(nnx.Module):

  def __init__(self, cfg, rngs):
    d, f, pdt = cfg.d_model, cfg.mlp_dim, jnp.dtype(cfg.param_dtype)
    self.gate = _param(rngs, (d, f), ("mlp_up_embed", "mlp"), pdt, d**-0.5)
    self.up = _param(rngs, (d, f), ("mlp_up_embed", "mlp"), pdt, d**-0.5)
    self.down = _param(rngs, (f, d), ("mlp", "mlp_down_embed"), pdt, f**-0.5)
    lora.attach(self, {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}, cfg, rngs)
    self.activation = cfg.mlp_activation
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x, key=None):
    """x [..., d_model], taken as one [tokens, d_model] matrix: with the batch and time axes kept
    apart, XLA:CPU transposed the activation gradient in a slow fused loop (2x the MLP's backward)."""
    dt = self.dtype
    x2 = x.reshape(-1, x.shape[-1])
    drops = [None] * 3 if key is None else list(jax.random.split(key, 3))
    h = ACTIVATIONS[self.activation](lora.project(self, "gate", x2, dt, drops[0])) * lora.project(
        self, "up", x2, dt, drops[1])
    return lora.project(self, "down", h, dt, drops[2]).reshape(x.shape)


# The residual stream [B, T, d_model]: split over the batch axes only (models.sharding).
RESIDUAL_AXES = ("batch", "length", "act_embed")
# A block's input after its norm: whole over the length on every device. With sequence
# parallelism (a pool's rules map length to tensor, Megatron-style) the residual between blocks is
# split over the sequence and gathered here, where heads and the MLP split over tensor instead.
BLOCK_INPUT_AXES = ("batch", "act_length", "act_embed")


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

  def __call__(self, x, table, mask, cache, cache_index, key=None):
    x = constrain(x, RESIDUAL_AXES)
    drops = (None, None) if key is None else tuple(jax.random.split(key))
    a, cache = self.attn(constrain(self.attn_norm(x), BLOCK_INPUT_AXES), table, mask, cache, cache_index, drops[0])
    x = constrain(x + (self.post_attn_norm(a) if self.post_norms else a), RESIDUAL_AXES)
    m = self.mlp(constrain(self.mlp_norm(x), BLOCK_INPUT_AXES), drops[1])
    return constrain(x + (self.post_mlp_norm(m) if self.post_norms else m), RESIDUAL_AXES), cache


class Decoder(nnx.Module):

  def __init__(self, cfg, rngs: nnx.Rngs):
    cfg = ml_collections.FrozenConfigDict(cfg)  # hashable, so the module's graphdef can key a jit cache
    pdt = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab_in", "embed_in"), pdt, cfg.d_model**-0.5)
    if cfg.scan_layers:
      self.layers = _stacked_blocks(cfg, rngs)
    else:
      self.layers = nnx.List([Block(cfg, rngs, is_sliding(cfg, i)) for i in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt, cfg.norm_style)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed_out", "vocab_out"), pdt, cfg.d_model**-0.5)

  def __call__(self, tokens, positions, mask, cache: Cache | None = None, cache_index=0, key_positions=None,
               rope_tables=None):
    """tokens, positions [B, T]; mask [B, T, S] -> logits [B, T, vocab] (fp32), new cache.
    rope_tables: from rope_tables(cfg, limit) when every position is below limit (decode loops)."""
    x, new_cache = self.hidden(tokens, positions, mask, cache, cache_index, key_positions, rope_tables)
    return self.logits(x), new_cache

  def hidden(self, tokens, positions, mask, cache: Cache | None = None, cache_index=0, key_positions=None,
             rope_tables=None, dropout_key=None):
    """As __call__, but -> the final hidden states [B, T, d_model] (after the final norm, in
    cfg.dtype), so a caller can run the output head over slices of them (see logits).
    dropout_key: the LoRA adapters' dropout (model.lora.dropout), for the trainer's updates."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    x = constrain(self.embed[...].astype(dt)[tokens], RESIDUAL_AXES)
    if cfg.embed_scale != 1.0:  # transformers rounds the scale to the weights' dtype
      x = x * jnp.asarray(np.float32(cfg.embed_scale).astype(cfg.param_dtype), dt)
    local_mask = None
    if cfg.sliding_window:
      local_mask = mask.windowed(cfg.sliding_window) if isinstance(mask, Segments) else window_mask(
          mask, positions, cfg.sliding_window, cache is not None, cache_index, key_positions)
    if rope_tables is None:
      tables = {args: rope_table(positions, *args) for args in layer_rope_settings(cfg)}
    else:  # tables over 0..limit-1: look the positions up
      tables = {args: (cos[0, positions], sin[0, positions]) for args, (cos, sin) in rope_tables.items()}

    def layer_inputs(sliding):  # (rope table, mask) of a sliding or full layer
      return tables[rope_settings(cfg, sliding)], local_mask if sliding else mask

    layer_key = lambda i: None if dropout_key is None else jax.random.fold_in(dropout_key, i)
    if cfg.scan_layers:
      x, new_cache = self._scan_layers(x, layer_inputs, cache, cache_index, layer_key)
    else:
      new_cache = []
      for i, layer in enumerate(self.layers):
        graphdef, state = nnx.split(layer)
        x, c = _block_fn(graphdef, cfg.remat, prevent_cse=True)(state, x, *layer_inputs(layer.sliding),
                                                                None if cache is None else cache[i], cache_index,
                                                                layer_key(i))
        new_cache.append(c)
    return self.final_norm(x), (new_cache if cache is not None or isinstance(cache_index, PrefixKV) else None)

  def _scan_layers(self, x, layer_inputs, cache, cache_index, layer_key):
    """The stacked layers over x by one scan; cache: [(keys [L, ...], values [L, ...])] or None.
    The cache rides in the carry, so each layer's write lands in place in the stacked buffers
    (as scan inputs and outputs, the old and new caches would be two buffers). A layer writes its
    new columns straight into them and reads its own slice (LayerColumn, PagedIndex.layer)."""
    cfg = self.cfg
    kinds = np.array([is_sliding(cfg, i) for i in range(cfg.n_layers)])
    mixed = kinds.any() and not kinds.all()  # Gemma 2/3 interleave sliding and full layers
    graphdef, state = nnx.split(self.layers)
    run = _block_fn(graphdef, cfg.remat, prevent_cse=False)  # scan already keeps XLA from merging the recompute

    def inputs_of(sliding):
      if mixed:
        return jax.tree.map(lambda a, b: jnp.where(sliding, a, b), layer_inputs(True), layer_inputs(False))
      return layer_inputs(bool(kinds[0]))

    layers = (state, jnp.arange(cfg.n_layers), jnp.asarray(kinds))
    if isinstance(cache_index, PrefixKV):  # each layer's cache a scan input or output of its own, never carried

      def prefix_body(x, xs):
        layer_state, i, sliding, layer_cache = xs
        return run(layer_state, x, *inputs_of(sliding), layer_cache, cache_index, layer_key(i))

      x, new = jax.lax.scan(prefix_body, x, layers + (None if cache is None else tuple(cache[0]),))
      return x, (None if new is None else [new])

    def body(carry, xs):
      x, stacked = carry
      layer_state, i, sliding = xs
      inputs = inputs_of(sliding)
      if stacked is None:
        x, _ = run(layer_state, x, *inputs, None, cache_index, layer_key(i))
      else:
        index = dataclasses.replace(cache_index, layer=i) if isinstance(cache_index, PagedIndex) else LayerColumn(
            i, cache_index)
        x, stacked = run(layer_state, x, *inputs, stacked, index, layer_key(i))
      return (x, stacked), None

    (x, stacked), _ = jax.lax.scan(body, (x, None if cache is None else tuple(cache[0])), layers)
    return x, (None if cache is None else [stacked])

  def head(self):
    """The output head [d_model, vocab] in the compute dtype: the tied embeddings or lm_head."""
    head = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
    return head.astype(jnp.dtype(self.cfg.dtype))

  def logits(self, x, columns=None):
    """Final hidden states x [..., d_model] -> fp32 logits [..., vocab] through the output head
    (the tied embeddings or lm_head) and the final soft-cap. columns: a slice of the vocabulary
    to compute only those logits (the critic reads one column of its head)."""
    head = self.head()
    return head_logits(x, head if columns is None else head[:, columns], self.cfg.final_logit_softcap)


def head_logits(x, head, cap):
  """Hidden states x [..., d_model] through an output head [d_model, vocab] in x's dtype -> fp32
  logits, soft-capped at `cap` (0: not). Accumulated and returned in fp32: rounded to bf16, logits
  are 1/8 to 1/4 apart where a trained model's top logits lie (16 to 64), and every logprob of a
  token less than certain carries that rounding."""
  return softcap(jnp.matmul(x, head, preferred_element_type=jnp.float32), cap)


REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _block_fn(graphdef, remat: str, prevent_cse: bool):
  """(block state, x, table, mask, cache, cache_index, dropout key) -> (x, cache), rematerialised as
  cfg.remat says (jax.checkpoint changes nothing outside differentiation, so decoding pays nothing)."""

  def run(state, x, table, mask, cache, cache_index, key):
    return nnx.merge(graphdef, state)(x, table, mask, cache, cache_index, key)

  if remat == "none":
    return run
  return jax.checkpoint(run, policy=REMAT_POLICIES[remat], prevent_cse=prevent_cse)


def _stacked_blocks(cfg, rngs) -> Block:
  """One Block holding every layer's params stacked [L, ...], each layer from its own key; its
  static settings are those of a full layer (the scan passes each layer its mask and RoPE)."""

  @nnx.split_rngs(splits=cfg.n_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return Block(cfg, rngs)

  blocks = make(rngs)
  for _, var in nnx.iter_graph(blocks):
    if isinstance(var, (nnx.Param, lora.Adapter)):
      var.set_metadata("axes", ("layers",) + var.get_metadata()["axes"])
  return blocks


def stack_layers(params: dict) -> dict:
  """Params of a scan_layers=False model -> those of the same model with scan_layers=True."""
  layers = params["layers"]
  return dict(params, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in range(len(layers))]))


def unstack_layers(params: dict, n_layers: int) -> dict:
  """The inverse of stack_layers."""
  return dict(params, layers={i: jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(n_layers)})


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
# The same with each KV head's head_dim folded into kv_heads: keys [B, KV * head_dim, S], values
# [B, S, KV * head_dim], for a rollout shard that holds one KV head. Attention reads a layer's
# cache right after a decode step writes its column; in the 4-d layout a shard's one-head axis is
# dropped between the two (a reshape), and XLA:CPU fused a copy of the write into that reshape,
# four whole-cache copies per layer and step. Here the read lines up with the write as it lies.
FLAT_CACHE_AXES = (("batch", "kv_heads", "length"), ("batch", "length", "kv_heads"))


def entry_axes(keys) -> tuple:
  """The logical axes of a (keys, values) cache entry, from its keys' rank."""
  return {3: FLAT_CACHE_AXES, 4: CACHE_AXES, 5: tuple(("layers",) + axes for axes in CACHE_AXES)}[keys.ndim]


def fold_heads(keys, values, entry):
  """New keys [B, KV, hd, T] and values [B, KV, T, hd] in the layout of cache entry `entry`."""
  if entry[0].ndim != 3:
    return keys, values
  b, kv, hd, t = keys.shape
  return keys.reshape(b, kv * hd, t), values.transpose(0, 2, 1, 3).reshape(b, t, kv * hd)


def unfold_heads(keys, values, kv: int):
  """A cache entry's keys and values (either layout) as attention reads them: [B, KV, hd, S], [B, KV, S, hd]."""
  if keys.ndim != 3:
    return keys, values
  b, _, s = keys.shape
  return keys.reshape(b, kv, -1, s), values.reshape(b, s, kv, -1).transpose(0, 2, 1, 3)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerColumn:
  """The cache_index of one layer of a stacked cache (model.scan_layers): the layer's new keys
  and values go to column `column` of slice `layer` of every layer's (keys [L, B, KV, hd, S],
  values [L, B, KV, S, hd]), in place. Taking the layer's slice out and putting it back whole
  instead copied the layer's cache twice more per layer at every decode step (W1: ~20% of it)."""
  layer: jax.Array  # [] int32
  column: jax.Array  # [] int32: the cache column of the first new token

  def write_read(self, cache, keys, values):
    """Writes keys [B, KV, hd, T] and values [B, KV, T, hd] -> (the layer's keys and values after
    the write, the stacked cache)."""
    stacked_k, stacked_v = cache
    stacked_k = jax.lax.dynamic_update_slice(stacked_k,
                                             keys.astype(stacked_k.dtype)[None], (self.layer, 0, 0, 0, self.column))
    stacked_v = jax.lax.dynamic_update_slice(stacked_v,
                                             values.astype(stacked_v.dtype)[None], (self.layer, 0, 0, self.column, 0))
    return layer_of(stacked_k, self.layer), layer_of(stacked_v, self.layer), (stacked_k, stacked_v)


def layer_of(stacked, layer):
  """Layer `layer` of a stacked [L, ...] cache array (the slice attention reads)."""
  return jax.lax.dynamic_index_in_dim(stacked, layer, 0, keepdims=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixKV:
  """The cache_index of the trainer's shared-prompt passes (rl.layout), where each layer's cache is
  its own, read or made per layer (a scan's input or output: carried whole, a differentiated scan
  keeps the whole stacked cache for every layer). rows None: the layer's new keys and values are
  its cache (the prompts' pass). rows [B]: row b attends to cache row rows[b]'s keys and values
  (its group's prompt) before its own new ones; nothing is written."""
  rows: jax.Array | None = None

  def write_read(self, cache, keys, values):
    """New keys [B, KV, hd, T] and values [B, KV, T, hd] -> (the keys and values attention reads,
    the layer's cache)."""
    if self.rows is None:
      return keys, values, (keys, values)
    prefix = lambda x, new: x[self.rows].astype(new.dtype)
    keys = jnp.concatenate([prefix(cache[0], keys), keys], axis=-1)
    return keys, jnp.concatenate([prefix(cache[1], values), values], axis=-2), None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedIndex:
  """The cache_index of a paged cache: each layer's (keys, values) is a pool of blocks in the
  cache layout, [blocks, KV, head_dim, P] and [blocks, KV, P, head_dim] (or flat), and row b's position p
  lives in block table[b, p // P] at column p % P. The blocks axis splits into `shards` equal
  parts (the data shards); row b belongs to shard b // (B / shards) and its table names blocks
  of that part, so under a mesh whose batch axes split both the rows and the blocks each
  device gathers and writes only its own blocks (vmap over the shards: XLA partitions the
  batched gather and scatter without collectives)."""
  table: jax.Array  # [B, M] int32: shard-local block ids; out of range for blocks not held (read clamped, masked)
  start: jax.Array  # [B] int32: the position of each row's first new token
  write: jax.Array  # [B] bool: rows whose new keys and values are written (a dead slot's are dropped)
  shards: int = dataclasses.field(default=1, metadata={"static": True})
  layer: jax.Array | None = None  # [] int32: the pools are stacked [L, ...] (model.scan_layers), this layer's

  def write_read(self, cache, keys, values):
    """Writes the new keys [B, KV, hd, T] and values [B, KV, T, hd] at positions start + t and
    -> (every row's table blocks gathered as keys [B, KV, hd, M P], values [B, KV, M P, hd], the
    new (keys, values) pools). Rows read their whole table: the mask hides positions not cached.
    Stacked pools are written and read at `layer` only, in place."""
    kv = keys.shape[1]
    write = jnp.broadcast_to(self.write[:, None], (self.write.shape[0], keys.shape[-1]))
    all_axes = FLAT_CACHE_AXES if cache[0].ndim == 3 else CACHE_AXES  # (stacked pools: per layer)
    pools = tuple(
        write_columns(pool, x, self.table, self.start, write, axes, self.shards, self.layer)
        for pool, x, axes in zip(cache, fold_heads(keys, values, cache), all_axes))
    layer = lambda pool: pool if self.layer is None else layer_of(pool, self.layer)
    read = (read_blocks(layer(pool), self.table, axes, self.shards) for pool, axes in zip(pools, all_axes))
    return *unfold_heads(*read, kv), pools


def split_shards(x, axis: int, shards: int):
  """x with its axis `axis` split as [shards, n // shards] (the data shard, then the shard's own)."""
  return x.reshape(x.shape[:axis] + (shards, x.shape[axis] // shards) + x.shape[axis + 1:])


def read_blocks(pool, table, axes, shards: int, extra: int = 0):
  """One array of a paged pool, [.., blocks, .., P, ..] in its cache `axes` (the batch axis
  counts blocks, the length axis holds P positions), -> each row's table [R, M] blocks in
  position order, then `extra` zero columns: [.., R, .., M P + extra, ..] (PagedIndex: ids are
  shard-local, a shard's rows read its blocks; blocks not held read clamped)."""
  b_ax, l_ax = axes.index("batch"), axes.index("length")
  (rows, m), page = table.shape, pool.shape[l_ax]
  width = m * page + extra

  def gather(p, tbl):  # one shard's blocks p [.., n, .., P, ..] and rows' tables tbl [r, M]
    blocks = jnp.moveaxis(jnp.take(p, tbl, axis=b_ax, mode="clip"), b_ax + 1, l_ax)  # [.., r, .., M, P, ..]
    line = blocks.reshape(blocks.shape[:l_ax] + (m * page,) + blocks.shape[l_ax + 2:])
    return jnp.pad(line, [(0, extra if a == l_ax else 0) for a in range(line.ndim)])

  out = jax.vmap(gather, in_axes=(b_ax, 0), out_axes=b_ax)(split_shards(pool, b_ax, shards),
                                                           split_shards(table, 0, shards))
  return out.reshape(pool.shape[:b_ax] + (rows,) + pool.shape[b_ax + 1:l_ax] + (width,) + pool.shape[l_ax + 1:])


def write_columns(pool, x, table, start, write, axes, shards: int, layer=None):
  """One array of a paged pool (read_blocks) with rows' columns x [.., R, .., T, ..] written at
  positions start [R] + t where write [R, T] says, through each row's table [R, M]; positions past
  the table and blocks not held are dropped. A scatter: XLA:CPU writes it element by element.
  layer: the pool leads with a layers axis [L, ..] (x and axes do not), x goes to that layer."""
  lead = () if layer is None else (layer,)  # indexes the pool's leading layers axis
  b_ax, l_ax = axes.index("batch"), axes.index("length")
  pool_b = len(lead) + b_ax  # the blocks axis of the pool itself
  (m, page), t = (table.shape[1], pool.shape[len(lead) + l_ax]), x.shape[l_ax]
  pos = start[:, None] + jnp.arange(t)  # [R, T]
  blk = jnp.take_along_axis(table, jnp.minimum(pos // page, m - 1), axis=1)
  blk = jnp.where(write & (pos < m * page), blk, pool.shape[pool_b])  # out of range: dropped
  every = lambda n: (slice(None),) * n
  put = lambda p, blk, off, u: p.at[lead + every(b_ax) + (blk,) + every(l_ax - b_ax - 1) + (off,)].set(u, mode="drop")
  # blocks and columns (and the layer) are indexed on axes apart, so the update leads with their [R, T]
  update = jnp.moveaxis(x, (b_ax, l_ax), (0, 1)).astype(pool.dtype)
  out = jax.vmap(put, in_axes=(pool_b, 0, 0, 0),
                 out_axes=pool_b)(split_shards(pool, pool_b, shards),
                                  *(split_shards(a, 0, shards) for a in (blk, pos % page, update)))
  return out.reshape(pool.shape)


def cache_axes(cfg, flat=False) -> list:
  """The logical axes of init_cache's arrays, in its structure: per layer, or stacked. flat:
  FLAT_CACHE_AXES (per layer only)."""
  if cfg.scan_layers:
    if flat:
      raise ValueError("a flat KV cache is per layer: not with model.scan_layers")
    return [tuple(("layers",) + axes for axes in CACHE_AXES)]
  return [FLAT_CACHE_AXES if flat else CACHE_AXES] * cfg.n_layers


def cache_shapes(cfg, batch, length, flat=False) -> list:
  """The shapes of init_cache's arrays, in its structure."""
  sizes = {
      "layers": cfg.n_layers,
      "batch": batch,
      "kv_heads": cfg.n_kv_heads * (cfg.head_dim if flat else 1),
      "head_dim": cfg.head_dim,
      "length": length
  }
  return [tuple(tuple(sizes[a] for a in axes) for axes in entry) for entry in cache_axes(cfg, flat)]


def init_cache(cfg, batch, length, dtype=None, flat=False) -> Cache:
  dt = jnp.dtype(dtype or cfg.dtype)
  return [tuple(jnp.zeros(shape, dt) for shape in entry) for entry in cache_shapes(cfg, batch, length, flat)]


def is_flat(cache: Cache) -> bool:
  """The cache is in FLAT_CACHE_AXES."""
  return entry_axes(cache[0][0]) == FLAT_CACHE_AXES


def map_cache(fn, cache: Cache, *others: Cache) -> Cache:
  """fn(array, *the same array of each of others, logical axes) over every array of a cache, so a
  caller finds the batch and length axes by name whatever the cache's layout."""
  return [
      tuple(fn(*arrays, axes) for *arrays, axes in zip(*entries, entry_axes(entries[0][0])))
      for entries in zip(cache, *others)
  ]
