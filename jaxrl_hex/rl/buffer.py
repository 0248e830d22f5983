"""Trajectory buffer and staleness gate: the one place where rollout and trainer clocks meet.

Rollout asks admit(k) before generating batch k; the gate holds it while k > version + eta
(AReaL's floor((generated - 1) / B) <= version + eta, with B = one trainer batch). take() hands
the trainer batches in batch order — replicas may finish out of order, but the data position
saved with a checkpoint must be that of a prefix — and drops any batch whose oldest token is
more than eta versions old. The staleness it hands back with a batch, per sample, is the one the
metrics report.
"""
import dataclasses
import threading

import numpy as np

from jaxrl_hex.data.rollouts import Rollout


@dataclasses.dataclass
class Item:
  batch_index: int
  rollout: Rollout  # scored
  data_state: dict  # prompt-stream state after this batch's prompts
  stats: dict = dataclasses.field(default_factory=dict)


class Closed(Exception):
  pass


class Buffer:

  def __init__(self, max_staleness: int, trainer_version: int = 0, next_batch: int = 0):
    self.max_staleness = max_staleness
    self._items: dict[int, Item] = {}
    self._next = next_batch
    self._version = trainer_version
    self._cond = threading.Condition()
    self._error: BaseException | None = None
    self._closed = False
    self.dropped = 0

  def admit(self, batch_index: int, timeout=None) -> bool:
    """Blocks until batch `batch_index` may be generated; False on timeout."""
    with self._cond:
      ok = self._cond.wait_for(lambda: self._closed or batch_index <= self._version + self.max_staleness, timeout)
      self._raise_if_closed()
      return ok

  def put(self, item: Item):
    with self._cond:
      self._raise_if_closed()
      self._items[item.batch_index] = item
      self._cond.notify_all()

  def take(self, timeout=None) -> tuple[Item, np.ndarray]:
    """-> (the next batch in order, staleness [N] int32 of each of its samples: the trainer's
    version minus the oldest version among the sample's tokens)."""
    with self._cond:
      while True:
        if not self._cond.wait_for(lambda: self._closed or self._next in self._items, timeout):
          raise TimeoutError(f"buffer: batch {self._next} did not arrive within {timeout}s")
        self._raise_if_closed()
        item = self._items.pop(self._next)
        self._next += 1
        staleness = self._version - item.rollout.oldest_versions()
        if staleness.max() <= self.max_staleness:
          return item, staleness
        self.dropped += 1

  def advance(self, trainer_version: int):
    with self._cond:
      self._version = trainer_version
      self._cond.notify_all()

  def close(self, error: BaseException | None = None):
    with self._cond:
      self._closed, self._error = True, error or self._error
      self._cond.notify_all()

  def _raise_if_closed(self):
    if self._closed:
      if self._error is not None:
        raise self._error
      raise Closed()
