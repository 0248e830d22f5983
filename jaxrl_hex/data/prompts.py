"""Prompt stream: a grain pipeline over a task split, reshuffled every epoch, checkpointable.

The split is grain's random-access source: a list, or a view that reads each record from its file
on demand (data/files.py), so only the batches drawn and a few read ahead are ever in memory.
Each batch carries the iterator state *after* it was drawn, so a checkpoint taken when the
trainer has consumed batch k resumes the stream at batch k + 1, however far rollout ran ahead.
"""
import grain

# Batches read ahead by background threads: enough to hide a file read behind the batch in use.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


class PromptStream:

  def __init__(self, records, batch_size: int, seed: int, shard_index: int = 0, shard_count: int = 1):
    n = len(records)
    # each record with its position in the split, its prompt group's id (grain passes an index of a
    # later epoch past the end: it wraps, as the source's reads do)
    ds = grain.MapDataset.source(records).map_with_index(lambda i, r: dict(r, index=i % n))
    if shard_count > 1:  # each host reads its own slice of the split
      ds = ds[shard_index::shard_count]
    ds = ds.shuffle(seed=seed).repeat(None).batch(batch_size, batch_fn=list)
    self._iter = iter(ds.to_iter_dataset(READ_OPTIONS))

  def next(self):
    """-> (records, state after this batch)."""
    batch = next(self._iter)
    return batch, self._iter.get_state()

  def set_state(self, state):
    self._iter.set_state(state)
