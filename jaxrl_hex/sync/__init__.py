"""Weight sync: the trainer publishes (version, params) in its layout; the rollout side
receives them in its own layout. One class per transport, chosen by config.sync.method."""
import os
import shutil
import threading
import time

import jax


class WeightSync:
  """publish() on the train side, latest_version() / receive() on the rollout side."""

  def __init__(self):
    self._cond = threading.Condition()
    self._version = -1
    self.last_seconds = 0.0

  def latest_version(self) -> int:
    with self._cond:
      return self._version

  def wait_for(self, version: int, timeout=None) -> bool:
    with self._cond:
      return self._cond.wait_for(lambda: self._version >= version, timeout)

  def _announce(self, version: int):
    with self._cond:
      self._version = version
      self._cond.notify_all()


class DevicePutSync(WeightSync):
  """In one runtime: reshard with jax.device_put straight onto the rollout shardings."""

  def __init__(self, target_shardings):
    super().__init__()
    self.target_shardings = target_shardings
    self._params = None

  def publish(self, version, params):
    start = time.perf_counter()
    resharded = jax.block_until_ready(jax.device_put(params, self.target_shardings))
    self.last_seconds = time.perf_counter() - start
    with self._cond:
      self._params = resharded
    self._announce(version)

  def receive(self):
    with self._cond:
      return self._version, self._params


class OrbaxSync(WeightSync):
  """Through storage: save from the train layout, restore onto the rollout layout.

  This is the transport separate runtimes use: restore takes an abstract target whose leaves
  carry the rollout shardings, so no process ever holds the train layout of the other side.
  Versions older than `keep` are deleted after each publish.
  """

  def __init__(self, directory, target_shardings, abstract_params, keep=2):
    import orbax.checkpoint as ocp
    super().__init__()
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    self.keep = keep
    self._ckpt = ocp.StandardCheckpointer()
    self._target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                abstract_params, target_shardings)
    self.receive_seconds = 0.0

  def _path(self, version):
    return os.path.join(self.directory, f"v{version:08d}")

  def publish(self, version, params):
    start = time.perf_counter()
    self._ckpt.save(self._path(version), params, force=True)
    self._ckpt.wait_until_finished()
    self.last_seconds = time.perf_counter() - start
    self._announce(version)
    for old in sorted(os.listdir(self.directory))[:-self.keep]:
      shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)

  def receive(self):
    version = self.latest_version()
    if version < 0:
      return version, None
    start = time.perf_counter()
    params = self._ckpt.restore(self._path(version), self._target)
    self.receive_seconds = time.perf_counter() - start
    return version, params


METHODS = ("device_put", "orbax")


def make_sync(method, target_shardings, abstract_params, directory):
  if method == "device_put":
    return DevicePutSync(target_shardings)
  if method == "orbax":
    return OrbaxSync(directory, target_shardings, abstract_params)
  raise ValueError(f"sync.method: unknown {method!r}; choose one of {METHODS}")
