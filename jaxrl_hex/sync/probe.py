"""The logprob probe: the rollout engine and the trainer score one fixed sequence with the same
weights version, and must agree.

The fingerprint (sync/fingerprint.py) shows the rollout side holds the published numbers; the
probe shows the engine computes with them what the trainer computes: its decode program, KV
cache, layout and dtype against the trainer's forward pass. Every sync.probe_every versions the
engine greedy-decodes the task's first eval prompt and the trainer recomputes the logprob of each
decoded token (at temperature 1; greedy decoding records those). The two reduce in different
orders over different layouts, so they agree to rounding, not bit for bit: sync.probe_tolerance is
the largest per-token gap allowed, in nats, raised to a 16-bit float's own rounding gap where the
model computes in one (tolerance_for).
"""
import math

import jax.numpy as jnp
import numpy as np

from jaxrl_hex.sync.fingerprint import SyncMismatch, first_difference

# The per-token gap rounding alone may leave between the engine's program and the trainer's, per
# unit of the compute dtype's machine epsilon (bfloat16: 1 nat, float16: 1/8): the two programs
# round at different places (a decode step's one-row matmuls, the trainer's many-row ones) and
# each layer carries the last one's difference on (benchmarks/bf16_gap.py measures it).
ROUNDING_GAP_PER_EPS = 128


def tolerance_for(configured: float, dtype) -> float:
  """The gap the probe allows a model computing in `dtype` (model.dtype): sync.probe_tolerance, or
  if larger the gap rounding alone may leave at that dtype's precision."""
  return max(float(configured), ROUNDING_GAP_PER_EPS * float(jnp.finfo(dtype).eps))


def check(version: int, engine_logp, trainer_logp, tolerance: float, fingerprints) -> float:
  """engine_logp, trainer_logp [C]: the probe tokens' logprobs on each side -> the largest gap;
  raises SyncMismatch above `tolerance`, naming the leaf that differs if one does (fingerprints():
  (the trainer's, the rollout side's), called only then)."""
  gap = np.abs(np.asarray(engine_logp, np.float64) - np.asarray(trainer_logp, np.float64))
  worst = int(np.argmax(gap)) if gap.size else 0
  if not gap.size or gap[worst] <= tolerance:
    return float(gap.max()) if gap.size else 0.0
  difference = first_difference(*fingerprints())
  if difference:
    cause = f"{difference}, so the transfer corrupted it"
    fix = "start the run again" if version == 0 else "--resume continues from the last checkpoint"
  else:
    cause = "every leaf's fingerprint agrees, so the engine's program computes differently from the trainer's"
    allow = f"--config.sync.probe_tolerance={_above(gap[worst])}"
    if version == 0:  # nothing trained yet, so no checkpoint to resume: the programs' rounding or a bug
      fix = (f"before this run's first step that is rounding or an engine bug: with model.dtype=bfloat16 run "
             f"--config.model.dtype=float32, or allow the gap with {allow}")
    else:
      cause += " (a model, cache or sharding bug, or rounding that training grew)"
      fix = f"--resume continues from the last checkpoint ({allow} allows the gap)"
  raise SyncMismatch(f"logprob probe at version {version}: probe token {worst}'s logprob is {engine_logp[worst]:.4f} "
                     f"on the rollout engine and {trainer_logp[worst]:.4f} on the trainer (gap {gap[worst]:.3g} > "
                     f"sync.probe_tolerance={tolerance:g}); {cause}; {fix}")


def _above(gap: float) -> str:
  """The gap rounded up in its first significant digit (0.12 -> 0.2), as a flag value."""
  unit = 10.0**math.floor(math.log10(gap))
  return f"{math.ceil(gap / unit) * unit:.1g}"
