"""Weight sync inside one JAX runtime."""
import time

import jax

from jaxrl_hex.sync.handle import Handle


class DevicePutSync:
  """In one runtime: jax.device_put straight onto the rollout shardings."""
  cross_process = False

  def __init__(self, target_shardings):
    self.target_shardings = target_shardings
    self.last_seconds = 0.0
    self._latest = (-1, None)

  def publish(self, version, params) -> Handle:
    start = time.perf_counter()
    # never alias: the trainer donates its params to the next step (pools may share devices)
    resharded = jax.block_until_ready(jax.device_put(params, self.target_shardings, may_alias=False))
    self.last_seconds = time.perf_counter() - start
    self._latest = (version, resharded)  # one tuple assignment: readers see a whole pair
    return Handle(version)

  def receive(self, handle: Handle):
    version, params = self._latest
    assert version >= handle.version, "device_put sync: asked for a version not yet published"
    return version, params
