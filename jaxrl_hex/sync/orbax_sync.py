"""Weight sync through a path every runtime can read (a shared disk, or one machine's)."""
import os
import re
import shutil
import time

import jax
import orbax.checkpoint as ocp

from jaxrl_hex.errors import UserError
from jaxrl_hex.sync.handle import Handle, target_structs


class OrbaxSync:
  """Through a shared path. Versions older than the newest `keep` are deleted after a publish."""
  cross_process = True

  def __init__(self, directory, shapes=None, target_shardings=None, keep=3):
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
    # uncompressed: zstd of float weights cost more time than the disk here (benchmarks/README.md, cluster-sync)
    self._ckpt = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    self._target = None if target_shardings is None else target_structs(shapes, target_shardings)
    self._restore_args = None if self._target is None else ocp.checkpoint_utils.construct_restore_args(self._target)
    self.last_seconds = 0.0

  def _path(self, version):
    return os.path.join(self.directory, f"v{version:08d}")

  def publish(self, version, params) -> Handle:
    start = time.perf_counter()
    # a synchronous save: a version is announced only once it is fully on disk
    self._ckpt.save(self._path(version), args=ocp.args.PyTreeSave(params), force=True)
    self.last_seconds = time.perf_counter() - start
    if jax.process_index() == 0:
      for old in self._versions()[:-self.keep]:
        shutil.rmtree(self._path(old), ignore_errors=True)
    return Handle(version, self._path(version))

  def close(self):
    self._ckpt.close()

  def settle(self) -> float:
    return 0.0  # publish() returns once its copy is made: nothing of it runs on

  def _versions(self):
    return sorted(int(m.group(1)) for m in map(re.compile(r"^v(\d{8})$").match, os.listdir(self.directory)) if m)

  def receive(self, handle: Handle):
    start = time.perf_counter()
    version = handle.version
    if not os.path.isdir(self._path(version)):  # superseded and deleted: the newest is as good
      version = self._versions()[-1]
    params = self._ckpt.restore(self._path(version), args=ocp.args.PyTreeRestore(item=self._target,
                                                                                 restore_args=self._restore_args))
    self.last_seconds = time.perf_counter() - start
    return version, params
