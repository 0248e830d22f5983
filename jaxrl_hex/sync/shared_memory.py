"""Direct weight sync within one host: each version written once, straight into the rollout layout.

Through Ray's object store a version is copied into the store (ray.put, on the trainer) and, where a
rollout region does not lie whole in it, out of it again. On one host the train process instead
writes each version into the rollout layout's tiles (a leaf's distinct regions, which tile it) in a
segment of /dev/shm, and every rollout process on the host aliases the tiles its devices hold: one
copy of the model's bytes, by the train process; the rollout side makes none.

A segment holds `slots` versions of one rollout layout; replicas of differing layouts get segments
of their own. A rollout process holding a slot (any of its arrays alias it: an engine decoding on
it, an evaluation engine kept since the last evaluation) has an entry (pid, slot) in the segment's
table, cleared by a finalizer on the slot's buffer when the last such array goes. A version goes
into the oldest slot no live process holds (holders that died are skipped); where every slot is
held the writer opens another segment for the layout, up to BANKS, and only then waits. A receiver
takes, under the same file lock, its version's slot once written, or the newest version where a
newer one took that slot (a superseded handle gets the newest, as orbax's).

The writer owns its segments: it unlinks them when it closes or exits, and a segment left by a
killed writer (its name carries the writer's pid) is removed by the next writer on the host.
"""
import atexit
import contextlib
import fcntl
import gc
import glob
import hashlib
import itertools
import math
import mmap
import os
import pickle
import secrets
import threading
import time
import weakref

import numpy as np

from jaxrl_hex.errors import UserError

DIRECTORY = "/dev/shm"
PREFIX = "jaxrl-hex-sync-"
SLOTS = 4  # versions a segment keeps: the engine's, one landing, one being written, the evaluation engine's
BANKS = 4  # segments a layout may take while rollout processes hold every slot
HOLDERS = 256  # entries of a segment's holder table: (pid, slot)
PAGE = 4096
HEADER = 24  # bytes: slots, bytes a slot, bytes of the table
POLL_S = 0.002


def room() -> int:
  """Bytes free in this host's shared-memory file system (Linux; 0 where there is none)."""
  if not (os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK)):
    return 0
  stat = os.statvfs(DIRECTORY)
  return stat.f_bavail * stat.f_frsize


def tiles(shape, spec, axis_sizes) -> list:
  """The distinct regions of an array of `shape` laid out by PartitionSpec `spec` over a mesh of
  `axis_sizes` (every split dim divides, meshes.PoolSpec.partition_spec): they tile the array."""
  per_dim = []
  for d, n in enumerate(shape):
    names = spec[d] if d < len(spec) else None
    names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
    k = math.prod(axis_sizes[a] for a in names)
    per_dim.append([(i * n // k, (i + 1) * n // k) for i in range(k)])
  return list(itertools.product(*per_dim))


def layout_key(table) -> str:
  """Names a rollout layout by its tiles: per leaf, their bounds (both sides compute it alike)."""
  return hashlib.sha1(repr(table).encode()).hexdigest()[:16]


def _alive(pid) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def writer_pid(name) -> int | None:
  """The pid of the process that wrote segment `name` (it is in the name), or None."""
  try:
    return int(os.path.basename(name)[len(PREFIX):].split("-")[0])
  except ValueError:
    return None


def remove_stale():
  """Unlinks segments whose writer died without doing so (killed): their pid no longer runs."""
  for path in glob.glob(os.path.join(DIRECTORY, PREFIX + "*")):
    pid = writer_pid(path)
    if pid is not None and not _alive(pid):
      try:
        os.unlink(path)
      except FileNotFoundError:
        pass


class Segment:
  """One rollout layout's version slots in /dev/shm.

  File: a header of int64s (slots, bytes a slot, bytes of the table), a control block of int64s
  (per slot the version it holds, -1 while written; then HOLDERS entries (pid, slot)), the pickled
  table of region placements, then the slots, page aligned."""

  def __init__(self, name, fd, placed, slot_bytes, slots, table_bytes):
    self.name, self._fd, self.placed, self.slot_bytes, self.slots = name, fd, placed, slot_bytes, slots
    self._data = -(-(self._table_offset(slots) + table_bytes) // PAGE) * PAGE
    self._map = mmap.mmap(fd, self._data + slots * slot_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    self._control = np.frombuffer(self._map, np.int64, slots + 2 * HOLDERS, HEADER)
    self._holders = self._control[slots:].reshape(HOLDERS, 2)
    self._lock = threading.Lock()  # flock excludes other processes, not this one's threads

  @staticmethod
  def _table_offset(slots):
    return HEADER + 8 * (slots + 2 * HOLDERS)

  @classmethod
  def create(cls, placed, slot_bytes, slots) -> "Segment":
    """A new segment (the writer's) for a layout whose regions lie at `placed` in a slot."""
    remove_stale()
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(os.path.join(DIRECTORY, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    table = pickle.dumps(placed)
    size = -(-(cls._table_offset(slots) + len(table)) // PAGE) * PAGE + slots * slot_bytes
    try:
      os.posix_fallocate(fd, 0, size)  # the pages now: a full /dev/shm fails here, not with SIGBUS later
    except OSError as e:
      os.close(fd)
      os.unlink(os.path.join(DIRECTORY, name))
      raise UserError(
          f"weight sync: cannot allocate {size / 2**20:.0f} MiB in {DIRECTORY} for {slots} versions of "
          f"the model ({e.strerror}); free memory there or use --config.sync.transport=object_store") from None
    os.pwrite(fd, np.array([slots, slot_bytes, len(table)], np.int64).tobytes(), 0)
    os.pwrite(fd, table, cls._table_offset(slots))
    segment = cls(name, fd, placed, slot_bytes, slots, len(table))
    segment._control[:slots] = np.arange(slots) - slots - 1  # below -1 (being written): none written yet
    return segment

  @classmethod
  def open(cls, name) -> "Segment":
    """A receiver's view of the writer's segment `name`."""
    path = os.path.join(DIRECTORY, os.path.basename(name))
    try:
      fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
      raise UserError(f"weight sync: shared-memory segment {path} is gone (its train process ended); the rollout "
                      "side must run on the train process's host while it runs, or use "
                      "--config.sync.transport=object_store") from None
    slots, slot_bytes, table_bytes = (int(n) for n in np.frombuffer(os.pread(fd, HEADER, 0), np.int64))
    placed = pickle.loads(os.pread(fd, table_bytes, cls._table_offset(slots)))
    return cls(name, fd, placed, slot_bytes, slots, table_bytes)

  def slot_buffer(self, slot) -> np.ndarray:
    """A fresh uint8 view of `slot` (its own Python object: a finalizer may watch it)."""
    return np.frombuffer(self._map, np.uint8, self.slot_bytes, self._data + slot * self.slot_bytes)

  @contextlib.contextmanager
  def _locked(self):
    with self._lock:
      fcntl.flock(self._fd, fcntl.LOCK_EX)
      try:
        yield
      finally:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

  # the writer

  def slot_of(self, version) -> int | None:
    """The slot holding `version` (published again without a step since), if any."""
    found = np.flatnonzero(self._control[:self.slots] == version)
    return int(found[0]) if len(found) else None

  def claim(self) -> tuple | None:
    """The oldest slot no live process holds, marked being written -> (slot, its buffer); None
    where live processes hold every slot."""
    with self._locked():
      held = set()
      for entry in np.flatnonzero(self._holders[:, 0]):
        pid, slot = (int(n) for n in self._holders[entry])
        if _alive(pid):
          held.add(slot)
        else:
          self._holders[entry] = 0
      free = [s for s in range(self.slots) if s not in held]
      if not free:
        return None
      slot = min(free, key=lambda s: self._control[s])
      self._control[slot] = -1
    return slot, self.slot_buffer(slot)

  def written(self, slot, version):
    with self._locked():
      self._control[slot] = version

  # a receiver

  def hold(self, slot, version, timeout_s) -> tuple:
    """`slot` once its writer is done with `version` there (waiting up to timeout_s), or the newest
    version written where a newer one took the slot -> (version, the slot's buffer), recorded as
    held by this process until that buffer and every view of it are gone."""
    deadline = time.monotonic() + timeout_s
    if np.count_nonzero(self._holders[:, 0] == os.getpid()) > 1:
      gc.collect(1)  # arrays of older versions often wait in a young reference cycle, holding their slot
    while True:
      with self._locked():
        now = int(self._control[slot])
        newest = int(self._control[:self.slots].max())
        if now != version and now != -1 and newest > version:  # superseded: the newest instead, as orbax's
          slot, version, now = int(np.argmax(self._control[:self.slots])), newest, newest
        free = np.flatnonzero(self._holders[:, 0] == 0)
        if now == version and len(free):
          entry = int(free[0])
          self._holders[entry] = (os.getpid(), slot)
          break
      if now == version:
        raise UserError(f"weight sync: {HOLDERS} versions held at once in {self.name}; a rollout process keeps "
                        "old params alive")
      writer = writer_pid(self.name)
      if not _alive(writer) or time.monotonic() > deadline:
        raise UserError(f"weight sync: version {version} is still being written after {timeout_s:g} s"
                        if _alive(writer) else f"weight sync: the train process ({writer}) died while writing version "
                        f"{version}; continue the run from its last checkpoint (--resume)")
      time.sleep(POLL_S)
    buffer = self.slot_buffer(slot)
    weakref.finalize(buffer, _release, self._holders, entry, os.getpid())
    return version, buffer

  def close(self, unlink=False):
    if unlink:
      try:
        os.unlink(os.path.join(DIRECTORY, self.name))
      except FileNotFoundError:
        pass
    try:  # views still alive (a receiver's params) keep the mapping; it goes with them
      del self._control, self._holders
      self._map.close()
    except (BufferError, AttributeError):
      pass


def _release(holders, entry, pid):
  if holders[entry, 0] == pid:  # one store: a writer reading it under the lock sees 0 or pid
    holders[entry] = 0


class SlotWriter:
  """The train side's segments, per rollout layout, unlinked when it closes or exits."""

  def __init__(self, slots=SLOTS, timeout_s=300.0):
    self.slots, self.timeout_s = slots, timeout_s
    self.segments = {}  # layout key -> [Segment]
    atexit.register(self.close)

  def claim(self, key, placed, slot_bytes, version) -> tuple:
    """A slot of layout `key` for `version` -> (segment, slot, its buffer to fill, or None where
    it holds `version` already); waits up to timeout_s where BANKS segments' slots are all held."""
    banks = self.segments.setdefault(key, [])
    for segment in banks:
      slot = segment.slot_of(version)
      if slot is not None:
        return segment, slot, None
    deadline = time.monotonic() + self.timeout_s
    while True:
      for segment in banks:
        claimed = segment.claim()
        if claimed is not None:
          return (segment, *claimed)
      if len(banks) < BANKS:
        banks.append(Segment.create(placed, slot_bytes, self.slots))
      elif time.monotonic() > deadline:
        raise UserError(f"weight sync: version {version} waited {self.timeout_s:g} s for a free slot in shared "
                        f"memory: rollout processes hold all {BANKS * self.slots} versions kept; one is stuck or "
                        "keeps old params alive (its stacks: jaxrl-hex report)")
      else:
        time.sleep(POLL_S)

  def close(self):
    for segment in itertools.chain(*self.segments.values()):
      segment.close(unlink=True)
    self.segments = {}
