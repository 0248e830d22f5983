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

On one host (sync.transport=shared_memory) publish instead writes each version straight into the
rollout layouts' regions in shared memory, which the rollout processes alias (sync/shared_memory.py).
"""
import concurrent.futures
import functools
import itertools
import math
import time

import jax
import numpy as np

from jaxrl_hex.errors import UserError
from jaxrl_hex.sync import shared_memory
from jaxrl_hex.sync.handle import Handle, target_structs
from jaxrl_hex.sync.regions import RegionPlan, owned

CHUNK_BYTES = 64 << 20  # a receiver fetches whole chunks: bounds what it holds beyond its own shards
SLICE_BYTES = 64 << 10  # below this a shard is not cut into slices (each is an object-store entry)
SHARED = "<shared memory>"  # a manifest's entry for a version in shared memory: {layout key: (segment, slot)}


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
      if key == SHARED:  # written by the one train process
        manifest[key] = shards
      else:
        manifest.setdefault(key, []).extend(shards)
  return Handle(version, manifest)


def rollout_layouts(pool_specs, logical_axes, shapes) -> list:
  """The distinct layouts of rollout pool specs (meshes.PoolSpec: no devices needed) as
  DirectSync's `layouts`: [(mesh axis sizes, tree of PartitionSpecs)]."""
  out = []
  for spec in pool_specs:
    specs = jax.tree.map(lambda axes, s, spec=spec: spec.partition_spec(axes, s.shape), logical_axes, shapes,
                         is_leaf=lambda x: isinstance(x, tuple))
    if (dict(spec.axes), specs) not in out:
      out.append((dict(spec.axes), specs))
  return out


def _tile_table(shapes, specs, axis_sizes) -> list:
  """Per leaf of `shapes`, the bounds of its tiles in a layout of PartitionSpecs `specs` over a mesh."""
  return [shared_memory.tiles(s.shape, p, axis_sizes) for s, p in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs))]


class DirectSync:
  cross_process = True

  def __init__(self, shapes, target_shardings=None, layouts=(), slots=shared_memory.SLOTS, timeout_s=300.0):
    """layouts: given on a train side sharing its host with the rollout processes
    (sync.transport=shared_memory): the rollout layouts as [(mesh axis sizes, tree of
    PartitionSpecs)]; each version is then written into their regions in shared memory, `slots`
    versions a segment, a write waiting up to timeout_s where rollout processes hold every slot."""
    self._plan = None if target_shardings is None else RegionPlan(target_structs(shapes, target_shardings))
    if self._plan is not None:  # the receiving layout's name, as the train side computes it
      self._targets = jax.tree.leaves(self._plan.targets)
      self._key = shared_memory.layout_key(
          [shared_memory.tiles(t.shape, t.sharding.spec, dict(t.sharding.mesh.shape)) for t in self._targets])
      self._segments = {}  # segment name -> Segment, opened on first use
    self._layouts = {}  # layout key -> RegionPlan filling its tiles
    for axis_sizes, specs in layouts:
      table = _tile_table(shapes, specs, axis_sizes)
      self._layouts.setdefault(shared_memory.layout_key(table), RegionPlan(shapes, regions=table))
    self._timeout_s = timeout_s
    self._writer = shared_memory.SlotWriter(slots, timeout_s) if self._layouts else None
    self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="direct-sync") if self._layouts else None
    self._pending = None  # the last shared write's ([Filling], future of its end)
    self.last_seconds = 0.0

  def publish_local(self, version, params) -> dict:
    """This process's manifest piece {leaf: [(bounds, (ref, i))]}: its shards packed into objects
    of up to CHUNK_BYTES (one ray.put per chunk, not per shard: a put costs ~0.5 ms whatever its
    size); the caller merges pieces (merge_manifests). With layouts, {SHARED: {layout key:
    (segment name, slot)}} instead: where the version is written for each rollout layout."""
    jax.block_until_ready(params)  # the step computing them is the trainer's own time, not the sync's
    if self._layouts:
      return self._write_shared(version, params)
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
      # the object store lays a chunk's arrays out in order, so a receiving region they fill end to
      # end is used in place (regions.py): a group starts a new chunk rather than straddle two
      for group in _in_order([(where, host()) for where, host in owned(leaf)]):
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

  def _write_shared(self, version, params) -> dict:
    """Claims a slot for `version` in each rollout layout's segments and returns; the copies into
    them run on beside the trainer (as device_put's do), each slot marked written when its copies
    end: a receiver waits for that."""
    start = time.perf_counter()
    self.settle()
    leaves = jax.tree.leaves(params)
    if not all(x.is_fully_addressable for x in leaves):
      raise UserError("sync.transport=shared_memory: the params span several train processes; one process writes "
                      "the shared versions: use --config.sync.transport=object_store")
    places, fills = {}, []
    for key, plan in self._layouts.items():
      segment, slot, buffer = self._writer.claim(key, plan.placed, plan.nbytes, version)
      if buffer is not None:
        fills.append((segment, slot, plan.start(lambda i, _: owned(leaves[i]), into=buffer)))
      places[key] = segment.name, slot
    self._pending = fills, self._copier.submit(self._fill, version, fills)
    self.last_seconds = time.perf_counter() - start
    return {SHARED: places}

  @staticmethod
  def _fill(version, fills):
    for segment, slot, filling in fills:
      filling.run()
      segment.written(slot, version)

  def settle(self) -> float:
    """Waits for the last shared write's copies out of the params (before they are donated), making
    copies too -> seconds waited. Through the object store publish() returns with its copy made."""
    start = time.perf_counter()
    if self._pending is not None:
      fills, done = self._pending
      for *_, filling in fills:
        filling.run()
      done.result()
    return time.perf_counter() - start

  def publish(self, version, params) -> Handle:
    return merge_manifests(version, [self.publish_local(version, params)])

  def close(self):
    if self._writer is not None:
      self._copier.shutdown(wait=True)
      self._writer.close()

  def receive(self, handle: Handle):
    """Each distinct region of the rollout layout assembled once from the object store's zero-copy
    views of the chunks overlapping it, or aliased where it lies whole in them (sync/regions.py); a
    chunk is fetched on first use."""
    if SHARED in handle.payload:
      return self._receive_shared(handle)
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

  def _receive_shared(self, handle: Handle):
    """The regions this process's devices hold, aliased where the trainer wrote them (every region
    is one of the layout's tiles, so none is copied); the slot is held while they live."""
    start = time.perf_counter()
    names = handle.payload[SHARED]
    if self._key not in names:
      raise UserError(f"weight sync: version {handle.version} was written for rollout layouts {sorted(names)}, "
                      f"not this process's ({self._key}); the train side computes the rollout layouts from the "
                      "mesh file: start both from the same one")
    name, slot = names[self._key]
    if name not in self._segments:  # a new writer's (a restarted trainer's): the old mappings go with their arrays
      writer = shared_memory.writer_pid(name)
      self._segments = {n: s for n, s in self._segments.items() if shared_memory.writer_pid(n) == writer}
      self._segments[name] = shared_memory.Segment.open(name)
    segment = self._segments[name]
    version, buffer = segment.hold(slot, handle.version, self._timeout_s)
    buffer.flags.writeable = False

    def sources_of(i, _):
      dtype = np.dtype(self._targets[i].dtype)
      return [
          (where,
           buffer[at:at + math.prod(b - a
                                    for a, b in where) * dtype.itemsize].view(dtype).reshape([b - a for a, b in where]))
          for where, at in segment.placed[i]
      ]

    params = self._plan.build(sources_of, alias=True)
    self.last_seconds = time.perf_counter() - start
    return version, params
