"""What the train side's publish hands to the rollout side: a small picklable record."""
import typing

import jax


class Handle(typing.NamedTuple):
  version: int
  payload: typing.Any = None  # orbax: directory of the version; direct: shard manifest
  fingerprint: typing.Any = None  # sync.fingerprint of the published params, on versions it is checked
  base: typing.Any = None  # LoRA: the Handle of the frozen base, published once; the params are the adapters


def target_structs(shapes, shardings):
  """ShapeDtypeStructs carrying the receiving layout: what Orbax restores onto, what direct builds."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
