"""Prompt stream: a grain pipeline over a task split, reshuffled every epoch, checkpointable.

Each batch carries the iterator state *after* it was drawn, so a checkpoint taken when the
trainer has consumed batch k resumes the stream at batch k + 1, however far rollout ran ahead.
"""
import grain


class PromptStream:

  def __init__(self, records, batch_size: int, seed: int, shard_index: int = 0, shard_count: int = 1):
    indexed = [dict(r, index=i) for i, r in enumerate(records)]
    ds = grain.MapDataset.source(indexed)
    if shard_count > 1:  # each host reads its own slice of the split
      ds = ds[shard_index::shard_count]
    ds = ds.shuffle(seed=seed).repeat(None).batch(batch_size, batch_fn=list)
    self._iter = iter(ds.to_iter_dataset())

  def next(self):
    """-> (records, state after this batch)."""
    batch = next(self._iter)
    return batch, self._iter.get_state()

  def set_state(self, state):
    self._iter.set_state(state)
