"""Host bookkeeping of a paged KV pool: which blocks each data shard has free, and who holds each.

The pool's blocks split evenly over the rollout pool's data shards, as the slots do; a slot only
holds blocks of its own shard (ids local to the shard), so its attention never reads across
devices. A block is held by one or more sequences (a group's full prompt blocks by each of its
samples on the shard) and returns to its shard's free list when the last holder lets go.
"""
import numpy as np


class BlockPool:
  """Free lists and reference counts of `blocks` blocks over `shards` data shards."""

  def __init__(self, blocks: int, shards: int):
    self.shards, self.per_shard = shards, blocks // shards
    self._free = [list(range(self.per_shard - 1, -1, -1)) for _ in range(shards)]  # pop() hands out low ids first
    self._refs = np.zeros((shards, self.per_shard), np.int32)

  def free(self, shard: int) -> int:
    """Blocks of `shard` nobody holds."""
    return len(self._free[shard])

  @property
  def held(self) -> int:
    """Blocks held, over all shards."""
    return self.shards * self.per_shard - sum(map(len, self._free))

  def take(self, shard: int, n: int) -> list:
    """n free blocks of `shard`, now held once each; the caller checked free(shard) >= n."""
    assert n <= len(self._free[shard]), (shard, n, len(self._free[shard]))
    ids = [self._free[shard].pop() for _ in range(n)]
    self._refs[shard, ids] = 1
    return ids

  def share(self, shard: int, ids):
    """One more holder of each of these (held) blocks."""
    self._refs[shard, list(ids)] += 1

  def release(self, shard: int, ids):
    """One holder fewer of each; blocks nobody holds any more go back to the free list."""
    for i in ids:
      self._refs[shard, i] -= 1
      if not self._refs[shard, i]:
        self._free[shard].append(i)

  def refs(self, shard: int, i: int) -> int:
    return int(self._refs[shard, i])
