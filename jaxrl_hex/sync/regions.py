"""Params onto a receiving layout from host-readable source shards, one host copy per distinct region.

Each device of the receiving layout holds one region of each leaf; devices on a replicated axis
hold the same region. A region is assembled once, from the source shards overlapping it, into a
64-byte-aligned host buffer, and every device holding it gets that buffer: on CPU devices JAX
aliases an aligned host buffer instead of copying it, so the whole transfer is one copy of the
distinct bytes (elsewhere device_put copies it on to the device, host to device). The buffers of
one transfer are slices of one arena, reused once no array aliases it any more (JAX holds a
reference to a host buffer it aliases), so a steady run copies into warm memory, not fresh pages.
"""
import gc
import math
import sys
import threading

import jax
import numpy as np

ALIGN = 64  # what XLA:CPU needs to alias a host buffer
ARENAS = 4  # kept for reuse: the engine's version, one waiting to switch in, one being received, a spare


def bounds(index, shape):
  """A tuple of slices -> ((start, stop), ...) with Nones resolved."""
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _aligned(nbytes: int) -> np.ndarray:
  raw = np.empty(nbytes + ALIGN, np.uint8)
  start = -raw.ctypes.data % ALIGN
  return raw[start:start + nbytes]


def fill(out: np.ndarray, want, sources, name: str):
  """Copies into `out` (the region `want`) the overlapping parts of `sources` [(bounds, array or a
  callable returning it, fetched only if it overlaps)]."""
  covered = 0
  for src, data in sources:
    lo = [max(a, c) for (a, _), (c, _) in zip(want, src)]
    hi = [min(b, d) for (_, b), (_, d) in zip(want, src)]
    if any(h <= l for l, h in zip(lo, hi)):
      continue
    data = data() if callable(data) else data
    out[tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, want))] = \
        data[tuple(slice(l - c, h - c) for l, h, (c, _) in zip(lo, hi, src))]
    covered += math.prod(h - l for l, h in zip(lo, hi))
  assert covered == out.size, f"weight sync: the shards of {name} do not cover {want}"


class RegionPlan:
  """Where each distinct region of a target tree (ShapeDtypeStructs carrying shardings) lies in an arena."""

  def __init__(self, targets):
    self.targets = targets
    self.leaves = []  # per leaf: [(region bounds, byte offset in the arena)]
    offset = 0
    for target in jax.tree.leaves(targets):
      placed = []
      for want in dict.fromkeys(
          bounds(i, target.shape) for i in target.sharding.addressable_devices_indices_map(target.shape).values()):
        placed.append((want, offset))
        nbytes = math.prod(b - a for a, b in want) * np.dtype(target.dtype).itemsize
        offset += -(-nbytes // ALIGN) * ALIGN
      self.leaves.append(placed)
    self.nbytes = offset
    self._arenas = []
    self._lock = threading.Lock()

  def _arena(self) -> np.ndarray:
    """A free arena: one whose buffer no array aliases (its one reference: the arena slice itself)."""
    for collect in (False, True):
      if collect:  # dropped arrays often wait in a young reference cycle; a full collection costs too much
        gc.collect(1)
      for arena in self._arenas:
        if sys.getrefcount(arena.base) <= 2:  # the slice's and the call's
          return arena
    arena = _aligned(self.nbytes)
    self._arenas = [arena] + self._arenas[:ARENAS - 1]  # one still aliased beyond those lives on by itself
    return arena

  def build(self, sources_of):
    """sources_of(leaf index, path) -> [(bounds, array or callable)] covering the leaf -> the
    target tree's arrays, on the receiving layout. One build at a time: it fills an arena."""
    with self._lock:
      return self._build(sources_of)

  def _build(self, sources_of):
    arena = self._arena()
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(self.targets)]
    out = []
    for i, (path, target, placed) in enumerate(zip(paths, jax.tree.leaves(self.targets), self.leaves)):
      name, sources = jax.tree_util.keystr(path), sources_of(i, path)
      views = {}
      for want, offset in placed:
        shape = [b - a for a, b in want]
        view = arena[offset:offset + math.prod(shape) * np.dtype(target.dtype).itemsize]
        views[want] = view.view(target.dtype).reshape(shape)
        fill(views[want], want, sources, name)
      # one batched put per leaf; every device holding a region gets its (aliased) buffer
      region = lambda index, views=views, shape=target.shape: views[bounds(index, shape)]
      out.append(jax.make_array_from_callback(target.shape, target.sharding, region))
    return jax.tree.unflatten(jax.tree.structure(self.targets), out)
