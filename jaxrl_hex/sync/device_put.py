"""Weight sync inside one JAX runtime.

Between CPU devices the published params are assembled on the host (sync/regions.py): one copy of
each distinct region of the rollout layout, aliased by every device holding it, where device_put
would copy each replica. That copy runs on a background thread, so the trainer goes on at once;
it reads the trainer's params, which the trainer's next step donates, so that step first waits
for the copy (settle(); the trainer is busy elsewhere until then: the rollout batch, the checks),
taking copies itself meanwhile; the first receive of the version wraps the regions as arrays.
A snapshot on the train devices instead (a jitted copy) measured 3-4x a memcpy's CPU time on top,
for every version, against a wait only when the copy is not done. Elsewhere (accelerators) a
device-to-device jax.device_put, which the runtime itself orders before that donation.
"""
import concurrent.futures
import threading
import time

import jax

from jaxrl_hex.sync.handle import Handle, target_structs
from jaxrl_hex.sync.regions import RegionPlan, owned


def _on_cpu(shardings) -> bool:
  return all(d.platform == "cpu" for s in jax.tree.leaves(shardings) for d in s.device_set)


class DevicePutSync:
  """In one runtime: params onto the rollout shardings at publish time."""
  cross_process = False

  def __init__(self, target_shardings):
    self.target_shardings = target_shardings
    self.last_seconds = 0.0  # what the last publish() held its caller
    self._latest = (-1, None)
    self._plan = None
    self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="device-put-sync")
    # its own thread: queued behind the copier's, a spare's page faults would delay the next copy
    self._sparer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="device-put-spare")
    self._pending = None  # the last publish's (version, future of its Filling)
    self._wrapping = threading.Lock()  # one receive wraps a version's regions, the others wait for it
    self._computing = None  # the last publish's params until settle() saw them computed

  def publish(self, version, params) -> Handle:
    start = time.perf_counter()
    self.settle()
    if self._plan is None and _on_cpu(jax.tree.map(lambda x: x.sharding, params)) and _on_cpu(self.target_shardings):
      self._plan = RegionPlan(target_structs(params, self.target_shardings))
    if self._plan is not None:
      leaves = jax.tree.leaves(params)
      started = concurrent.futures.Future()
      self._pending = version, started
      self._copier.submit(self._copy, leaves, started)
      self._computing = leaves
    else:
      # never alias: the trainer donates its params to the next step (pools may share devices)
      self._latest = (version, jax.device_put(params, self.target_shardings, may_alias=False))
    self.last_seconds = time.perf_counter() - start
    return Handle(version)

  def _copy(self, leaves, started):
    try:
      filling = self._plan.start(lambda i, _: owned(leaves[i]))
    except BaseException as e:
      started.set_exception(e)
      raise
    started.set_result(filling)
    filling.run()  # a copy that fails raises in every thread running the fill: settle() and receive() too
    self._sparer.submit(self._plan.spare)

  def _help(self):
    """Runs the last publish's copies along with its thread -> (its version, its regions), or None."""
    pending = self._pending  # the trainer and the rollout side may both wait on it
    if pending is None:
      return None
    version, started = pending
    return version, started.result().run()

  def settle(self) -> float:
    """Waits for the last publish's copy out of the params (before they are donated), helping it
    along -> seconds waited. The copy starts once the step computing them is done; waiting for that
    step is the trainer's own time, not sync's: it is not counted."""
    computing, self._computing = self._computing, None
    jax.block_until_ready(computing)
    start = time.perf_counter()
    self._help()
    return time.perf_counter() - start

  def close(self):
    self._copier.shutdown(wait=True)
    self._sparer.shutdown(wait=True)

  def receive(self, handle: Handle):
    copied = self._help()
    if copied is not None:
      # wrapped here, not by the copying thread after its copies: a receive waiting for that thread
      # to wrap them ended 0.7-1.0 ms after the wrap (128 MB, 75 leaves), wrapping them itself 0.5-0.7
      with self._wrapping:
        if self._latest[0] < copied[0]:
          self._latest = (copied[0], self._plan.arrays(copied[1]))  # one tuple assignment: a whole pair
    version, params = self._latest
    assert version >= handle.version, "device_put sync: asked for a version not yet published"
    return version, params
