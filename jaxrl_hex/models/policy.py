"""The policy's structure apart from its weights: models are pure functions over parameter
pytrees, so jit, sharding and checkpoints see plain dicts."""
import dataclasses
import typing

import jax
import numpy as np
from flax import nnx

from jaxrl_hex.models import lora
from jaxrl_hex.models.decoder import Decoder


@dataclasses.dataclass(frozen=True)
class Policy:
  """The model's structure (graphdef) plus each parameter's logical axes; params live outside."""
  cfg: typing.Any
  graphdef: typing.Any
  abstract: typing.Any  # nnx.State of ShapeDtypeStruct leaves carrying `axes` metadata
  dropout_key: typing.Any = None  # the LoRA adapters' dropout key inside a trainer update (with_dropout)

  @classmethod
  def build(cls, cfg):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    return cls(cfg, graphdef, abstract)

  @property
  def lora(self) -> bool:
    """Whether the model carries LoRA adapters (model.lora.rank > 0): only they are trained."""
    return bool(self.cfg.lora.rank)

  def split(self, tree):
    """A params-shaped pure dict -> (trainable, frozen): (adapters, base) with LoRA, else (tree, {})."""
    return lora.split(tree) if self.lora else (tree, {})

  def base(self) -> "Policy":
    """The same model without adapters: the frozen base's structure (what a full-weight checkpoint,
    an HF directory or the merged rollout weights hold)."""
    if not self.lora:
      return self
    cfg = self.cfg.copy_and_resolve_references()
    cfg.lora.rank = 0
    return Policy.build(cfg)

  def with_dropout(self, key) -> "Policy":
    """This policy with its adapters' dropout on, keyed by `key` (inside a traced update)."""
    return dataclasses.replace(self, dropout_key=key)

  def shapes(self):
    """Pure dict of ShapeDtypeStruct, the structure of every params pytree."""
    return nnx.to_pure_dict(self.abstract)

  def logical_axes(self):
    """Pure dict of axis-name tuples, one per parameter."""
    return nnx.to_pure_dict(
        jax.tree.map(lambda v: v.get_metadata()["axes"], self.abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)))

  def init(self, seed: int, shardings=None):
    """Fresh params, created directly in their shardings (never whole on one device)."""
    return jax.jit(self._fresh, out_shardings=shardings)(_key_data(seed))

  def init_adapters(self, seed: int, shardings=None):
    """Fresh adapters alone (the base they would sit on is never computed: XLA drops it)."""
    return jax.jit(lambda key: self.split(self._fresh(key))[0], out_shardings=shardings)(_key_data(seed))

  def _fresh(self, key_data):
    """key_data: an input, not a constant, so every seed runs one program (compiled once, then
    read from the persistent compilation cache where one is set: ~0.25 s against ~3 s)."""
    return nnx.to_pure_dict(nnx.split(Decoder(self.cfg, nnx.Rngs(jax.random.wrap_key_data(key_data))))[1])

  def apply(self, params, tokens, positions, mask, cache=None, cache_index=0, key_positions=None, rope_tables=None):
    """-> (logits [B, T, vocab] fp32, cache). key_positions [B, S], rope_tables: see models.decoder."""
    return self.module(params)(tokens, positions, mask, cache, cache_index, key_positions, rope_tables)

  def apply_hidden(self, params, tokens, positions, mask, cache=None, cache_index=0, key_positions=None,
                   rope_tables=None):
    """As apply, but -> (final hidden states [B, T, d_model] in cfg.dtype, cache): the output head
    left to `logits`, so a caller can run it over slices (the trainer's chunked logprobs)."""
    return self.module(params).hidden(tokens, positions, mask, cache, cache_index, key_positions, rope_tables,
                                      self.dropout_key)

  def logits(self, params, hidden, columns=None):
    """Hidden states [..., d_model] from apply_hidden -> fp32 logits [..., vocab], as apply
    computes them; columns: a slice of the vocabulary to compute only those."""
    return self.module(params).logits(hidden, columns)

  def module(self, params) -> Decoder:
    """The nnx Decoder holding `params` (no copy)."""
    return nnx.merge(self.graphdef, self._with_values(params))

  def _with_values(self, params):
    state = jax.tree.map(lambda v: v, self.abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    nnx.replace_by_pure_dict(state, params)
    return state


def _key_data(seed: int) -> np.ndarray:
  """nnx.Rngs(seed)'s key as host data: a numpy input every process of a multi-host pool passes alike."""
  return np.asarray(jax.random.key_data(jax.random.key(seed)))


def param_bytes(params) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
