"""Trajectory buffer and staleness gate: the one place where rollout and trainer clocks meet.

Rollout asks admit(k) before generating batch k; the gate holds it while k > version + eta
(AReaL's floor((generated - 1) / B) <= version + eta, with B = one trainer batch). take() hands
the trainer the oldest batch and drops any whose oldest token is more than eta versions old.
"""
import dataclasses
import threading
import typing


@dataclasses.dataclass
class Item:
  batch_index: int
  rollout: typing.Any       # rollout.engine.Rollout, scored
  data_state: dict          # prompt-stream state after this batch's prompts
  version: int              # oldest policy version among its tokens
  spans: list = dataclasses.field(default_factory=list)


class Closed(Exception):
  pass


class Buffer:

  def __init__(self, max_staleness: int, trainer_version: int = 0):
    self.max_staleness = max_staleness
    self._items: list[Item] = []
    self._version = trainer_version
    self._cond = threading.Condition()
    self._error: BaseException | None = None
    self._closed = False
    self.dropped = 0

  def admit(self, batch_index: int, timeout=None) -> bool:
    """Blocks until batch `batch_index` may be generated; False on timeout."""
    with self._cond:
      ok = self._cond.wait_for(
          lambda: self._closed or batch_index <= self._version + self.max_staleness, timeout)
      self._raise_if_closed()
      return ok

  def put(self, item: Item):
    with self._cond:
      self._raise_if_closed()
      self._items.append(item)
      self._cond.notify_all()

  def take(self, timeout=None) -> tuple[Item, int]:
    """-> (item, staleness) for the current trainer version."""
    with self._cond:
      while True:
        if not self._cond.wait_for(lambda: self._closed or self._items, timeout):
          raise TimeoutError(f"buffer: no rollout arrived within {timeout}s")
        self._raise_if_closed()
        item = self._items.pop(0)
        staleness = self._version - item.version
        if staleness <= self.max_staleness:
          return item, staleness
        self.dropped += 1
        self._cond.notify_all()

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
