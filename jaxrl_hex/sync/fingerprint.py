"""A cheap check that the rollout side holds the weights the trainer published.

Per leaf, two float32 sums computed on each side from its own shards (a jitted reduction, so no
leaf is gathered): of the values, and of the values times a fixed position-dependent weight, so
shards that arrive swapped, zeroed or garbled change it. The two sides reduce in different
orders over different layouts, so they are compared to within 1e-5 of the sum of the terms'
magnitudes (float32 rounding of a pairwise sum stays well inside it).
"""
import math

import jax
import jax.numpy as jnp

from jaxrl_hex.errors import RunStopped

TOLERANCE = 1e-5


def _leaf_sums(x):
  x = x.astype(jnp.float32)
  phase = sum((d + 1) * 0.6180339887 * jax.lax.broadcasted_iota(jnp.float32, x.shape, d) for d in range(x.ndim))
  terms = (x, x * jnp.sin(phase + 0.3))
  return jnp.stack([jnp.sum(t) for t in terms] + [jnp.sum(jnp.abs(t)) for t in terms])


@jax.jit
def _sums(params):
  return jax.tree.map(_leaf_sums, params)


def fingerprint(params) -> dict:
  """{leaf path: (sum, weighted sum, sum |x|, sum |weighted|)} on the host."""
  sums = jax.device_get(_sums(params))
  return {jax.tree_util.keystr(p): tuple(float(v) for v in s) for p, s in jax.tree_util.tree_leaves_with_path(sums)}


class SyncMismatch(RunStopped):
  """The weights a rollout runtime received differ from what the trainer published."""


def first_difference(expected: dict, got: dict) -> str | None:
  """The first leaf whose sums differ between two fingerprints, as a phrase, or None."""
  for path, want in expected.items():
    have = got.get(path)
    if have is None:
      return f"leaf {path} is missing on the rollout side"
    for k in (0, 1):
      if not math.isclose(have[k], want[k], rel_tol=0.0, abs_tol=TOLERANCE * max(want[k + 2], 1e-30)):
        return f"leaf {path} differs on the rollout side (sum {have[k]:.6g}, the trainer's {want[k]:.6g})"
  return None


def check(expected: dict, params, version: int):
  """Raises SyncMismatch naming the first leaf whose sums differ."""
  difference = first_difference(expected, fingerprint(params))
  if difference:
    raise SyncMismatch(f"weight sync of version {version}: {difference}: the transfer corrupted it; the "
                       "checkpoints are the trainer's own, so --resume continues from the last one "
                       "(sync.verify_every sets how often this is checked)")
