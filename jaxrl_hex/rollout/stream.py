"""Chunks of prompt groups streamed through one running engine (a rollout replica of a fleet).

A routed replica does not generate a chunk and then idle until the next one arrives: chunks are
submitted while others decode, the engine's slots are refilled from its queue as sequences
finish, and a chunk comes back once every sample of its groups is done. Several batches can share
the engine's decode steps. Each group's samples are keyed by its batch's rng and its group id
(Engine.group_requests), so they do not depend on which chunk, replica or step they ran in.
"""
import dataclasses
import time

from jaxrl_hex.rollout.engine import Batch


@dataclasses.dataclass
class _Chunk:
  batch: Batch
  samples: list = dataclasses.field(default_factory=list)


class ChunkStream:
  """submit(key, prompts, group_size, rng, group_ids) queues a chunk; advance() runs one hand-back
  of the engine and returns [(key, Rollout)] of the chunks it completed."""

  def __init__(self, engine):
    self.engine = engine
    self._chunks = {}  # key -> _Chunk, in submission order

  def submit(self, key, prompts: list, group_size: int, rng, group_ids=None):
    if key in self._chunks:
      raise ValueError(f"chunk {key!r} is already in the stream")
    requests, batch = self.engine.group_requests(prompts, group_size, rng, group_ids)
    for r in requests:
      r.id = (key, r.id)
    self.engine.submit(requests)
    self._chunks[key] = _Chunk(batch)

  @property
  def rows(self) -> int:
    """Samples queued or decoding."""
    return sum(c.batch.rows - len(c.samples) for c in self._chunks.values())

  def __len__(self) -> int:
    return len(self._chunks)

  def advance(self, max_s: float = 0.0, group_size: int = 1, arrived=lambda: False) -> list:
    """Hand-backs of the engine (at most steps_per_sync decode steps each) -> [(key, Rollout)] of
    the chunks they finished. One, or with max_s > 0 as many as run until a chunk finishes, the
    engine could take another group of `group_size` samples that it does not have (its slots
    would idle), `arrived()` says new work waits for it elsewhere, or max_s passed: a caller
    across a network pays its round trip per chunk, not per hand-back."""
    t0, done = time.perf_counter(), []
    while self._chunks:
      for s in self.engine.poll():
        key, s.request_id = s.request_id
        self._chunks[key].samples.append(s)
      done = [k for k, c in self._chunks.items() if len(c.samples) == c.batch.rows]
      hungry = not self.engine.queued and self.engine.free_slots >= group_size
      if done or hungry or arrived() or time.perf_counter() - t0 >= max_s:
        break
    return [(k, self.engine.assemble(c.batch, c.samples)) for k, c in ((k, self._chunks.pop(k)) for k in done)]
