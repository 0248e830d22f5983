"""Weight sync: the train side publishes (version, params) in its layout and gets back a small
picklable Handle; the rollout side turns a handle into params in its own layout.

  device_put  one JAX runtime: reshard onto the rollout shardings at publish time
  orbax       any runtimes sharing a path: save from the train layout, restore straight onto
              the rollout layout (an abstract target carrying the rollout shardings)
  direct      Ray runtimes: every trainer process puts its own shards in the object store;
              each rollout process fetches only the shards overlapping its devices (sync/direct.py)
"""
import os
import re
import shutil
import time
import typing

import jax

from jaxrl_hex.errors import UserError

METHODS = ("device_put", "orbax", "direct")


class Handle(typing.NamedTuple):
  version: int
  payload: typing.Any = None  # orbax: directory of the version; direct: shard manifest


def _target(shapes, shardings):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


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


class OrbaxSync:
  """Through a shared path. Versions older than the newest `keep` are deleted after a publish."""
  cross_process = True

  def __init__(self, directory, shapes=None, target_shardings=None, keep=3):
    import orbax.checkpoint as ocp
    self.directory = os.path.abspath(directory)
    try:
      os.makedirs(self.directory, exist_ok=True)
      probe = os.path.join(self.directory, f".write-probe-{os.getpid()}")
      open(probe, "w").close()
      os.remove(probe)
    except OSError as e:
      raise UserError(f"sync.directory: cannot write to {self.directory} ({e.strerror}); "
                      "point --config.sync.directory at a writable shared path") from None
    self.keep = keep
    self._ckpt = ocp.StandardCheckpointer()
    self._target = None if target_shardings is None else _target(shapes, target_shardings)
    self.last_seconds = 0.0

  def _path(self, version):
    return os.path.join(self.directory, f"v{version:08d}")

  def publish(self, version, params) -> Handle:
    start = time.perf_counter()
    self._ckpt.save(self._path(version), params, force=True)
    self._ckpt.wait_until_finished()  # a version is announced only once it is fully on disk
    self.last_seconds = time.perf_counter() - start
    if jax.process_index() == 0:
      for old in self._versions()[:-self.keep]:
        shutil.rmtree(self._path(old), ignore_errors=True)
    return Handle(version, self._path(version))

  def _versions(self):
    return sorted(int(m.group(1)) for m in map(re.compile(r"^v(\d{8})$").match, os.listdir(self.directory)) if m)

  def receive(self, handle: Handle):
    start = time.perf_counter()
    version = handle.version
    if not os.path.isdir(self._path(version)):  # superseded and deleted: the newest is as good
      version = self._versions()[-1]
    params = self._ckpt.restore(self._path(version), self._target)
    self.last_seconds = time.perf_counter() - start
    return version, params


def make_sync(method, shapes, target_shardings=None, directory=""):
  """target_shardings: the rollout layout, needed where params are received (None: publish only)."""
  if method == "device_put":
    return DevicePutSync(target_shardings)
  if method == "orbax":
    return OrbaxSync(directory, shapes, target_shardings)
  if method == "direct":
    from jaxrl_hex.sync.direct import DirectSync
    return DirectSync(shapes, target_shardings)
  raise UserError(f"sync.method: unknown {method!r}; choose one of {METHODS}")
