import threading
import time

import numpy as np
import pytest

from jaxrl_hex.data.rollouts import Rollout
from jaxrl_hex.rl.buffer import Buffer, Closed, Item


def _item(k, version, *more_versions):
  """Batch k: one single-token sample per version."""
  versions = np.array([[version, *more_versions]], np.int32).T  # [N, 1]
  empty = np.zeros_like(versions)
  rollout = Rollout(empty, empty, empty, np.ones_like(versions, bool), empty, versions, np.arange(len(versions)))
  return Item(k, rollout=rollout, data_state={})


def test_gate_admits_at_most_eta_batches_ahead():
  buf = Buffer(max_staleness=2, trainer_version=0)
  assert buf.admit(0, timeout=0) and buf.admit(2, timeout=0)
  assert not buf.admit(3, timeout=0.01)
  buf.advance(1)
  assert buf.admit(3, timeout=0)


def test_eta_zero_admits_only_the_current_batch_and_blocks_until_the_step():
  buf = Buffer(max_staleness=0, trainer_version=0)
  assert buf.admit(0, timeout=0)
  admitted = []
  t = threading.Thread(target=lambda: admitted.append(buf.admit(1, timeout=5)))
  t.start()
  time.sleep(0.05)
  assert not admitted  # batch 1 waits for the trainer to finish step 0
  buf.advance(1)
  t.join()
  assert admitted == [True]


def test_take_drops_batches_staler_than_eta():
  buf = Buffer(max_staleness=1, trainer_version=3)
  buf.put(_item(0, version=1))  # staleness 2 > 1: dropped
  buf.put(_item(1, version=2))
  item, staleness = buf.take(timeout=1)
  assert (item.batch_index, staleness.max(), buf.dropped) == (1, 1, 1)


def test_take_returns_each_samples_staleness():
  buf = Buffer(max_staleness=2, trainer_version=3)
  buf.put(_item(0, 3, 1, 2))
  assert buf.take(timeout=1)[1].tolist() == [0, 2, 1]


def test_batches_come_out_in_order_whatever_order_they_finish_in():
  buf = Buffer(max_staleness=3, trainer_version=0, next_batch=5)
  buf.put(_item(7, version=0))
  buf.put(_item(6, version=0))
  with pytest.raises(TimeoutError, match="batch 5"):
    buf.take(timeout=0.01)
  buf.put(_item(5, version=0))
  assert [buf.take(timeout=1)[0].batch_index for _ in range(3)] == [5, 6, 7]


def test_close_with_error_reaches_the_trainer():
  buf = Buffer(max_staleness=1)
  buf.close(RuntimeError("rollout died"))
  with pytest.raises(RuntimeError, match="rollout died"):
    buf.take(timeout=1)
  clean = Buffer(max_staleness=1)
  clean.close()
  with pytest.raises(Closed):
    clean.admit(0)
