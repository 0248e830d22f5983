"""Params onto a receiving layout from host-readable source shards, one host copy per distinct region.

Each device of the receiving layout holds one region of each leaf; devices on a replicated axis
hold the same region. A region is assembled once, from the source shards overlapping it, into a
64-byte-aligned host buffer, and every device holding it gets that buffer: on CPU devices JAX
aliases an aligned host buffer instead of copying it, so the whole transfer is one copy of the
distinct bytes (elsewhere device_put copies it on to the device, host to device). The buffers of
one transfer are slices of one arena, reused once no array aliases it any more (JAX holds a
reference to a host buffer it aliases), so a steady run copies into warm memory, not fresh pages.

Which parts of which source land where depends only on the two layouts, so it is worked out once
per source layout (`_planned`); a transfer is then one np.copyto per overlap. Sources that are
immutable (the object store's) may instead be aliased where a region already lies in them whole:
sources that are consecutive runs of the region in row-major order (one source; shards stacked
along the first axis; a stacked-layers leaf's per-layer slices, sync/direct.py) lying back to
back in memory.
"""
import collections
import functools
import gc
import math
import sys
import threading
import typing

import jax
import numpy as np
from jax._src import core  # the one batched put per leaf (arrays)
from jax._src.interpreters import pxla

ALIGN = 64  # what XLA:CPU needs to alias a host buffer
ARENAS = 4  # kept for reuse: the engine's version, one waiting to switch in, one being received, a spare


def bounds(index, shape):
  """A tuple of slices -> ((start, stop), ...) with Nones resolved."""
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


_OWNED = {}  # (sharding, shape) -> [(shard number, bounds)] of its distinct shards (replica 0 each)
# Shard reads (_host), one at a time in the process: the threads running a fill's copies (and
# those of another layout's fill of the same params) may each take the first look at an array's
# shards, and jaxlib builds that list on first use; a thread that reached it while another was
# half-way (a garbage collection can switch threads there) got a short one (`addressable_data(3)`:
# IndexError in one suite run). A read is ~13 us; the copies still run in parallel.
_READ = threading.Lock()


def owned(x) -> list:
  """A jax.Array's distinct addressable shards -> [(bounds, a callable returning the shard's host
  ndarray)]: the bounds are worked out once per sharding, and a host view is taken only when a
  copy reads it, by whichever thread runs that copy (a 75-leaf model has 300 shards at ~13 us
  each: 4-6 ms before any copy could start, when they were read up front)."""
  key = (x.sharding, x.shape)
  if key not in _OWNED:
    _OWNED[key] = [(k, bounds(s.index, x.shape)) for k, s in enumerate(x.addressable_shards) if s.replica_id == 0]
  return [(where, functools.partial(_host, x, k)) for k, where in _OWNED[key]]


def _host(x, k) -> np.ndarray:
  with _READ:
    return np.asarray(x.addressable_data(k))


def _aligned(nbytes: int) -> np.ndarray:
  raw = np.empty(nbytes + ALIGN, np.uint8)
  start = -raw.ctypes.data % ALIGN
  return raw[start:start + nbytes]


def _touched(arena: np.ndarray, chunk: int = 1 << 24) -> np.ndarray:
  """arena with every page faulted in: on this VM a fresh 128 MB arena's first copy took 0.19-0.42 s
  against 0.03-0.08 s into a reused one. Chunked, so no one call holds the GIL for long."""
  for i in range(0, arena.nbytes, chunk):
    arena[i:i + chunk] = 0
  return arena


class _Span:
  """Arrays lying back to back in memory seen as one array; keeps them (and what they view) alive."""

  def __init__(self, parts, shape, dtype):
    self.parts = parts
    self.__array_interface__ = dict(shape=tuple(shape), typestr=np.dtype(dtype).str, version=3,
                                    data=(parts[0].ctypes.data, not parts[0].flags.writeable))


def _in_place(parts, shape, dtype):
  """The region made of `parts` (stacked along the first axis) without a copy, or None where they
  are not aligned, contiguous, back to back arrays of the region's dtype."""
  if any(p.dtype != dtype or not p.flags.c_contiguous for p in parts) or parts[0].ctypes.data % ALIGN:
    return None
  if any(a.ctypes.data + a.nbytes != b.ctypes.data for a, b in zip(parts, parts[1:])):
    return None
  return parts[0] if len(parts) == 1 else np.asarray(_Span(parts, shape, dtype))


def _runs(sources, want):
  """The order in which `sources` (bounds) follow each other in the region `want` laid out row-major,
  where each is one contiguous run of it and together they fill it end to end; else None.

  A source is a contiguous run where its extent is 1 on every axis before some axis m and the
  region's own on every axis after m (whole shards stacked along the first axis: m = 0)."""
  shape = [b - a for a, b in want]
  strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
  runs = []
  for k, src in enumerate(sources):
    extent = [d - c for c, d in src]
    if any(c < a or d > b for (a, b), (c, d) in zip(want, src)):
      return None
    m = next((i for i, e in enumerate(extent) if e != 1), len(extent))
    if extent[m + 1:] != shape[m + 1:]:
      return None
    runs.append((sum((c - a) * st for (a, _), (c, _), st in zip(want, src, strides)), math.prod(extent), k))
  end = 0
  for start, size, _ in sorted(runs):
    if start != end:
      return None
    end += size
  return [k for *_, k in sorted(runs)] if end == math.prod(shape) else None


class _Copy(typing.NamedTuple):
  source: int  # which of the leaf's sources
  into: tuple  # slices of the region
  take: tuple  # slices of the source


class _Region(typing.NamedTuple):
  shape: tuple
  offset: int  # bytes into the arena
  copies: list  # [_Copy] covering the region
  stack: list | None  # sources that tile the region as consecutive row-major runs, in order; else None


class RegionPlan:
  """Where each distinct region of a target tree (ShapeDtypeStructs carrying shardings) lies in an arena,
  and which parts of which source shards fill it."""

  def __init__(self, targets, regions=None):
    """regions: per leaf, the bounds of the regions to fill (sync/shared_memory.py: a receiving
    layout's tiles, on the train side); default: those the targets' addressable devices hold."""
    self.targets = targets
    self._leaves = jax.tree.leaves(targets)
    self._names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(targets)]
    self._wanted = []  # per leaf: [(region bounds, byte offset in the arena)]
    self._puts = []  # per leaf: (its aval, its addressable devices, the region number each holds)
    offset = 0
    for n, target in enumerate(self._leaves):
      if regions is None:
        index_of = target.sharding.addressable_devices_indices_map(target.shape)
        wanted = list(dict.fromkeys(bounds(i, target.shape) for i in index_of.values()))
        aval = core.update_aval_with_sharding(core.ShapedArray(target.shape, target.dtype), target.sharding)
        self._puts.append((aval, list(index_of), [wanted.index(bounds(i, target.shape)) for i in index_of.values()]))
      else:
        wanted = regions[n]
      placed = []
      for want in wanted:
        placed.append((want, offset))
        nbytes = math.prod(b - a for a, b in want) * np.dtype(target.dtype).itemsize
        offset += -(-nbytes // ALIGN) * ALIGN
      self._wanted.append(placed)
    self.nbytes = offset
    self._layouts = {}  # source layout -> per leaf [_Region]
    self._arenas = []
    self._lock = threading.Lock()

  def _planned(self, layout):
    """layout: per leaf, the bounds of its sources -> per leaf, its [_Region]s."""
    if layout not in self._layouts:
      self._layouts[layout] = [[self._region(want, offset, sources, name) for want, offset in placed]
                               for placed, sources, name in zip(self._wanted, layout, self._names)]
    return self._layouts[layout]

  @staticmethod
  def _region(want, offset, sources, name) -> _Region:
    copies, covered = [], 0
    for k, src in enumerate(sources):
      lo = [max(a, c) for (a, _), (c, _) in zip(want, src)]
      hi = [min(b, d) for (_, b), (_, d) in zip(want, src)]
      if any(h <= l for l, h in zip(lo, hi)):
        continue
      copies.append(
          _Copy(k, tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, want)),
                tuple(slice(l - c, h - c) for l, h, (c, _) in zip(lo, hi, src))))
      covered += math.prod(h - l for l, h in zip(lo, hi))
    shape = tuple(b - a for a, b in want)
    assert covered == math.prod(shape), f"weight sync: the shards of {name} do not cover {want}"
    order = _runs([sources[c.source] for c in copies], want)
    return _Region(shape, offset, copies, None if order is None else [copies[k].source for k in order])

  def _free(self, collect=True):
    """A kept arena whose buffer no array aliases (its one reference: the arena slice itself), or None."""
    for attempt in range(1 + collect):
      if attempt:  # dropped arrays often wait in a young reference cycle; a full collection costs too much
        gc.collect(1)
      for arena in self._arenas:
        if sys.getrefcount(arena.base) <= 2:  # the slice's and the call's
          return arena
    return None

  def _keep(self, arena):
    self._arenas = [arena] + self._arenas[:ARENAS - 1]  # one still aliased beyond those lives on by itself

  def _arena(self) -> np.ndarray:
    arena = self._free()
    if arena is None:
      arena = _aligned(self.nbytes)
      self._keep(arena)
    return arena

  def spare(self):
    """Makes sure a free arena with its pages faulted in waits for the next fill, so no fill copies
    into fresh pages (a thread beside the copies calls it after each fill: the faults then cost
    that thread's time, not the wait for the copies)."""
    with self._lock:
      if self._free(collect=False) is not None:
        return
    arena = _touched(_aligned(self.nbytes))
    with self._lock:
      self._keep(arena)

  @property
  def placed(self) -> list:
    """Per leaf, [(region bounds, byte offset)]: where each region lies in an arena."""
    return self._wanted

  def start(self, sources_of, alias=False, into=None) -> "Filling":
    """sources_of(leaf index, leaf name) -> [(bounds, array or a callable returning it, called only
    if it overlaps)] covering the leaf -> the fill of every leaf's regions, its copies still to run.
    alias: the sources are immutable and outlive what is built on them, so a region lying whole in
    them is used in place. The regions hold their arena (no other fill takes it) until dropped.
    into: a uint8 buffer of nbytes to fill instead of an arena of the plan's own."""
    with self._lock:
      sources = [sources_of(i, name) for i, name in enumerate(self._names)]
      plan = self._planned(tuple(tuple(src for src, _ in leaf) for leaf in sources))
      arena = self._arena() if into is None else into
      regions, copies = [], []
      for target, leaf, planned in zip(self._leaves, sources, plan):
        data = {}

        def get(k, leaf=leaf, data=data):
          if k not in data:
            data[k] = leaf[k][1]() if callable(leaf[k][1]) else leaf[k][1]
          return data[k]

        views = []
        for region in planned:
          view = _in_place([get(k) for k in region.stack], region.shape, target.dtype) \
              if alias and region.stack else None
          if view is None:
            nbytes = math.prod(region.shape) * np.dtype(target.dtype).itemsize
            view = arena[region.offset:region.offset + nbytes].view(target.dtype).reshape(region.shape)
            copies += [(view, get, c) for c in region.copies]  # sliced by the thread that copies it
          views.append(view)
        regions.append(views)
      return Filling(regions, copies)

  def arrays(self, regions):
    """A fill's regions -> the target tree's arrays, on the receiving layout: every device holding a
    region gets its (on CPU aliased) buffer, one batched put per leaf: the put make_array_from_callback
    ends in, without what it works out again at every call (each device's index, the aval, checks of
    every value), which took more of a receive's time than the put itself."""
    out = [
        pxla.batched_device_put(aval, target.sharding, [views[r] for r in held], devices)
        for target, views, (aval, devices, held) in zip(self._leaves, regions, self._puts)
    ]
    return jax.tree.unflatten(jax.tree.structure(self.targets), out)

  def build(self, sources_of, alias=False):
    return self.arrays(self.start(sources_of, alias).run())


class Filling:
  """A fill under way: its copies, taken one at a time by every thread that runs it (the one that
  started it, and any that would otherwise wait for it: on loaded cores, more of the CPU for it)."""

  def __init__(self, regions, copies):
    self.regions = regions  # per leaf, its regions' host arrays
    self._copies = collections.deque(copies)  # (region view, its leaf's source getter, _Copy); popleft is atomic
    self._left = len(copies)
    self._lock = threading.Lock()
    self._done = threading.Event()
    self._failed = None  # a copy's exception: the regions are incomplete
    if not copies:
      self._done.set()

  def run(self) -> list:
    """Makes copies until none is left to take, then waits for those others took -> the regions.
    Raises in every thread that runs it if any copy failed: a helper that only waited must not
    hand on regions holding an older version's bytes where that copy was to land."""
    while True:
      try:
        view, get, c = self._copies.popleft()
      except IndexError:
        break
      try:
        np.copyto(view[c.into], get(c.source)[c.take])
      except BaseException as e:
        self._failed = e
        raise
      finally:  # counted even if it failed, so no runner waits forever
        with self._lock:
          self._left -= 1
          if not self._left:
            self._done.set()
    self._done.wait()
    if self._failed is not None:
      raise RuntimeError("weight sync: a region copy failed") from self._failed
    return self.regions
