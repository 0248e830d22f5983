"""The rollout side's weights when the trainer trains LoRA adapters: the frozen base arrives once
(its own Handle, handle.base), each version's adapters on top of it. Served either

  unmerged  the engine runs the adapted model on (base, adapters): x W + s (x A) B, no copy of W
  merged    each version is folded into a copy of the targeted weights, W + s A B, and the engine
            runs the plain model: faster decode steps, one more copy of those weights held

(rollout.lora_serving). Either way the received adapters are kept, so a fingerprint check or the
probe compares what the trainer published.
"""
import jax

from jaxrl_hex.models import lora

SERVING = ("unmerged", "merged")


class AdapterWeights:

  def __init__(self, policy, shardings, serving: str):
    """policy: the adapted model; shardings: its whole params' on the rollout layout."""
    self.serving = serving
    self.engine_policy = policy.base() if serving == "merged" else policy
    self.base_handle, self.base = None, None
    self.adapters = None  # (version, adapters) last received
    self._assembled = (None, None)  # (version, params): engines of one runtime share them
    # only the targeted weights are folded anew; the rest of the base is the received arrays
    fold = lambda whole: lora.pick(lora.merged(whole, policy.cfg), lora.adapted(whole))
    self._fold = jax.jit(fold, out_shardings=lora.adapted(shardings))

  def needs_base(self, handle) -> bool:
    return handle.base is not None and handle.base != self.base_handle

  def set_base(self, handle, base):
    self.base_handle, self.base, self._assembled = handle, base, (None, None)

  def assemble(self, version: int, adapters):
    """The engine's params of `version`, whose adapters are `adapters` (on this layout)."""
    if self._assembled[0] != version:
      self.adapters = (version, adapters)
      whole = lora.merge(adapters, self.base)
      self._assembled = (version, lora.merge(self.base, self._fold(whole)) if self.serving == "merged" else whole)
    return self._assembled[1]
