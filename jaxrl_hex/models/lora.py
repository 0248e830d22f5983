"""Low-rank adapters (LoRA, Hu et al. 2021) on the decoder's projections.

A targeted weight W [in..., out...] gains A [in..., r] and B [r, out...] beside it, as the module
attribute `<weight>_lora` ({"a", "b"}), so a params dict holds them at e.g.
layers/0/attn/wq_lora/a. The projection computes x W + (alpha / r) dropout(x) A B; B starts at
zero, so a fresh adapter changes no output (not even a bit: the base's product plus exact zeros).
A starts as PEFT's (Kaiming-uniform, bound 1 / sqrt(fan_in)).

Adapters are their own variable type and carry logical axes like the weights they adapt (the
rank axis "lora_rank" is never split), so they shard under the same rules tables. Everything
else in the model is the frozen base: `split` and `merge` move between one params dict and the
(adapters, base) pair, for whatever pytree shares the params' structure (shapes, axes, shardings).
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_hex.models.config import LORA_TARGETS, lora_targets

SUFFIX = "_lora"


class Adapter(nnx.Variable):
  """A LoRA factor: trained, checkpointed and synced apart from the frozen base."""


class LoRA(nnx.Module):

  def __init__(self, weight_shape, weight_axes, n_in: int, lora, rngs):
    """weight_shape / weight_axes: the adapted weight's; its first n_in dims are its input."""
    r = lora.rank
    fan_in = math.prod(weight_shape[:n_in])
    bound = 1.0 / math.sqrt(fan_in)
    self.a = Adapter(jax.random.uniform(rngs.params(), weight_shape[:n_in] + (r,), jnp.float32, -bound, bound),
                     axes=tuple(weight_axes[:n_in]) + ("lora_rank",))
    self.b = Adapter(jnp.zeros((r,) + tuple(weight_shape[n_in:]), jnp.float32),
                     axes=("lora_rank",) + tuple(weight_axes[n_in:]))
    self.scale = lora.alpha / r
    self.dropout = lora.dropout

  def __call__(self, x2, dt, key=None):
    """x2 [tokens, in] (the weight's input dims flattened) -> [tokens, out] in dt; key: dropout's
    (None: no dropout, as in the rollout engine and the trainer's start pass)."""
    if key is not None and self.dropout:
      x2 = jnp.where(jax.random.bernoulli(key, 1.0 - self.dropout, x2.shape), x2 / (1.0 - self.dropout), 0)
    a, b = self.a[...].astype(dt), self.b[...].astype(dt)
    return ((x2 @ a.reshape(-1, a.shape[-1])) @ b.reshape(b.shape[0], -1)) * jnp.asarray(self.scale, dt)


def attach(module, names: dict, cfg, rngs):
  """Gives `module` (an Attention or MLP) a LoRA beside each weight it holds that cfg targets.
  names: {weight attribute: PEFT name}."""
  targeted = lora_targets(cfg)
  for weight, name in names.items():
    if name in targeted:
      w = getattr(module, weight)
      setattr(module, weight + SUFFIX, LoRA(w.shape, w.get_metadata()["axes"], LORA_TARGETS[name][2], cfg.lora, rngs))


def project(module, weight: str, x2, dt, key=None):
  """x2 [tokens, in] through module.<weight> ([in..., out...]) and its adapter, if any -> [tokens, out]."""
  w = getattr(module, weight)[...].astype(dt)
  n_out = math.prod(w.shape) // x2.shape[-1]
  y = x2 @ w.reshape(-1, n_out)
  adapter = getattr(module, weight + SUFFIX, None)
  return y if adapter is None else y + adapter(x2, dt, key)


def adapter_path(path) -> bool:
  """Whether a key path (a tuple of dict keys, or jax key entries) lies in an adapter."""
  return any(str(getattr(k, "key", k)).endswith(SUFFIX) for k in path)


def split(tree: dict) -> tuple:
  """A params-shaped pure dict -> (adapters, base), each a pure dict of the same nesting holding
  only its leaves (empty branches dropped)."""
  adapters, base = {}, {}
  for key, value in tree.items():
    if str(key).endswith(SUFFIX):
      adapters[key] = value
    elif isinstance(value, dict):
      a, b = split(value)
      if a:
        adapters[key] = a
      if b:
        base[key] = b
    else:
      base[key] = value
  return adapters, base


def merge(*trees: dict) -> dict:
  """The union of pure dicts with disjoint leaves (the inverse of split)."""
  out = {}
  for tree in trees:
    for key, value in tree.items():
      out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
  return out


def adapted(params: dict) -> dict:
  """The weights in `params` that carry an adapter (each beside its `<name>_lora`), alone."""
  out = {}
  for key, value in params.items():
    if isinstance(value, dict) and not str(key).endswith(SUFFIX):
      sub = adapted(value)
      if sub:
        out[key] = sub
    elif str(key) + SUFFIX in params:
      out[key] = value
  return out


def pick(tree: dict, like: dict) -> dict:
  """The leaves of `tree` at the paths of `like`'s."""
  return {k: pick(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def zeros_like_b(adapters: dict) -> dict:
  """The adapters with every B zero: the base's function, at no copy of the base (the KL reference)."""
  return {
      k: (dict(v, b=jnp.zeros_like(v["b"])) if str(k).endswith(SUFFIX) else zeros_like_b(v))
      for k, v in adapters.items()
  }


def merged(params: dict, cfg, dtype=None) -> dict:
  """Params with every adapter folded into its weight, W + (alpha / r) A B (computed in fp32, cast
  to W's dtype, or `dtype`): the params of the same model without adapters. Leading stacked-layer
  dims (model.scan_layers) are kept."""
  scale = cfg.lora.alpha / cfg.lora.rank if cfg.lora.rank else 0.0
  out = {}
  for key, value in params.items():
    if str(key).endswith(SUFFIX):
      continue
    if isinstance(value, dict):
      out[key] = merged(value, cfg, dtype)
      continue
    adapter = params.get(str(key) + SUFFIX)
    out[key] = value if adapter is None else _fold(value, adapter["a"], adapter["b"], scale, dtype)
  return out


def _fold(w, a, b, scale, dtype):
  lead = a.ndim - (w.ndim - (b.ndim - 1)) - 1  # stacked layers: a [L, in..., r], b [L, r, out...], w [L, in..., out...]
  r = a.shape[-1]
  a2 = a.astype(jnp.float32).reshape(a.shape[:lead] + (-1, r))
  b2 = b.astype(jnp.float32).reshape(b.shape[:lead + 1] + (-1,))
  delta = (a2 @ b2).reshape(w.shape) * scale
  return (w.astype(jnp.float32) + delta).astype(dtype or w.dtype)
