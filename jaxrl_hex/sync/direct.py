"""Direct weight transfer through Ray's object store, shard by shard.

publish(): each trainer process puts only the shards it owns (replica 0 of each addressable
shard), packed into chunks of up to CHUNK_BYTES, and returns a manifest piece {leaf path:
[(index, (ref, position in chunk))]}; the driver merges the pieces of all processes into one
Handle. receive(): a rollout process assembles each distinct region its devices hold once, from
zero-copy views of the chunks holding source shards that overlap it (sync/regions.py), fetching
only those chunks, so no process gathers much more of the model than its devices hold. Two
copies at most: into the object store, and out of it into the receiving layout; a region that
already lies whole in a chunk is aliased where it lies, not copied.

A receiving layout usually lacks the train layout's fsdp axis, so its region of a leaf joins the
shards that differ along the leaf's first split axis. publish lays them out as that region lies
in memory: shards split along the first axis back to back; a stacked-layers leaf [L, ...] split
along a later axis as per-layer slices, each layer's slices of the shards in turn (_in_order).
"""
import functools
import itertools
import math
import time

import jax
import numpy as np

from jaxrl_hex.sync.handle import Handle, target_structs
from jaxrl_hex.sync.regions import RegionPlan, bounds

CHUNK_BYTES = 64 << 20  # a receiver fetches whole chunks: bounds what it holds beyond its own shards
SLICE_BYTES = 64 << 10  # below this a shard is not cut into slices (each is an object-store entry)


def _key(path) -> str:
  return jax.tree_util.keystr(path)


def _in_order(owned) -> list:
  """A leaf's shards [(bounds, array)] -> groups of (bounds, array) to put, in this order: the
  shards grouped by their bounds off the first axis j they differ along, each group's shards in
  order along j; where j > 0, each shard cut into slices at every index of the axes before j (none
  of them split), the slices at one index of the group's shards in turn. A region joining a group
  along j then lies in it end to end, as its row-major layout has it (regions._runs)."""
  if not owned:  # another process holds the leaf's replica 0
    return []
  axes = range(len(owned[0][0]))
  j = next((a for a in axes if len({b[a] for b, _ in owned}) > 1), 0)
  lead = owned[0][1].shape[:j]
  if math.prod(lead) > 1 and owned[0][1].nbytes // math.prod(lead) < SLICE_BYTES:
    lead = ()  # slices too small: the object store's per-entry cost would outweigh a copy
  off_j = lambda shard: shard[0][:j] + shard[0][j + 1:]
  groups = []
  for _, group in itertools.groupby(sorted(owned, key=lambda s: (off_j(s), s[0][j])), key=off_j):
    group = list(group)
    groups.append([_slice(where, data, index) for index in np.ndindex(*lead) for where, data in group])
  return groups


def _slice(where, data, index):
  """Shard (bounds, array) at `index` of its leading axes, kept as axes of extent 1 (a view)."""
  at = tuple((a + i, a + i + 1) for (a, _), i in zip(where, index))
  return at + where[len(index):], data[tuple(slice(i, i + 1) for i in index)]


def merge_manifests(version, pieces) -> Handle:
  manifest = {}
  for piece in pieces:
    for key, shards in piece.items():
      manifest.setdefault(key, []).extend(shards)
  return Handle(version, manifest)


class DirectSync:
  cross_process = True

  def __init__(self, shapes, target_shardings=None):
    self._plan = None if target_shardings is None else RegionPlan(target_structs(shapes, target_shardings))
    self.last_seconds = 0.0

  def publish_local(self, params) -> dict:
    """This process's manifest piece {leaf: [(bounds, (ref, i))]}: its shards packed into objects
    of up to CHUNK_BYTES (one ray.put per chunk, not per shard: a put costs ~0.5 ms whatever its
    size); the caller merges pieces (merge_manifests)."""
    import ray
    start = time.perf_counter()
    piece, chunk, waiting = {}, [], []  # waiting: (leaf's entry list, bounds) of each shard in chunk
    chunk_bytes = 0

    def flush():
      nonlocal chunk_bytes
      if chunk:
        ref = ray.put(list(chunk))
        for position, (entry, bounds) in enumerate(waiting):
          entry.append((bounds, (ref, position)))
        chunk.clear()
        waiting.clear()
        chunk_bytes = 0

    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
      entry = piece.setdefault(_key(path), [])
      owned = [(bounds(s.index, leaf.shape), np.asarray(s.data)) for s in leaf.addressable_shards if s.replica_id == 0]
      # the object store lays a chunk's arrays out in order, so a receiving region they fill end to
      # end is used in place (regions.py): a group starts a new chunk rather than straddle two
      for group in _in_order(owned):
        if chunk and chunk_bytes + sum(data.nbytes for _, data in group) > CHUNK_BYTES:
          flush()
        for where, data in group:
          if chunk and chunk_bytes + data.nbytes > CHUNK_BYTES:
            flush()
          chunk.append(data)
          chunk_bytes += data.nbytes
          waiting.append((entry, where))
    flush()
    self.last_seconds = time.perf_counter() - start
    return piece

  def settle(self) -> float:
    return 0.0  # publish() returns once its copy is made: nothing of it runs on

  def publish(self, version, params) -> Handle:
    return merge_manifests(version, [self.publish_local(params)])

  def receive(self, handle: Handle):
    """Each distinct region of the rollout layout assembled once from the object store's zero-copy
    views of the chunks overlapping it, or aliased where it lies whole in them (sync/regions.py); a
    chunk is fetched on first use."""
    import ray
    start = time.perf_counter()
    chunks = {}  # ref -> its list of shards

    def fetch(ref, i):
      if ref not in chunks:
        chunks[ref] = ray.get(ref)
      return chunks[ref][i]

    def sources_of(_, name):
      return [(src, functools.partial(fetch, ref, i)) for src, (ref, i) in handle.payload[name]]

    params = self._plan.build(sources_of, alias=True)  # the object store's buffers are immutable
    self.last_seconds = time.perf_counter() - start
    return handle.version, params
