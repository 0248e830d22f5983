"""The reward scorer (tasks/scoring.py): a reward that hangs, raises, dies or returns a
non-finite number costs its sample's score and is counted, never a worker or the run."""
import math
import os
import time
import types

import numpy as np
import pytest

from jaxrl_hex.tasks.scoring import RewardError, RewardScorer


def reward(prompt, completion, answer):
  if completion == "hang":
    time.sleep(3600)
  if completion == "raise":
    raise ValueError("bad completion")
  if completion == "die":
    os._exit(7)
  if completion in ("nan", "inf", "1e39"):
    return float(completion)  # 1e39 overflows float32
  return float(completion == answer)


def scorer(timeout_s=1.0, workers=4):
  return RewardScorer(types.SimpleNamespace(name="toy", reward=reward), timeout_s, workers)


def score(s, completions, answer="ok"):
  return s([""] * len(completions), completions, [answer] * len(completions))


def test_hung_calls_are_killed_and_their_workers_replaced():
  s = scorer(timeout_s=1.0, workers=4)
  first = {w.proc.pid for w in s._pool}
  completions = ["hang"] * 5 + ["ok", "no", "ok"]  # more hung calls than workers: each one gets one
  np.testing.assert_array_equal(score(s, completions), [0, 0, 0, 0, 0, 1, 0, 1])
  assert s.errors == 5
  pids = {w.proc.pid for w in s._pool}
  assert all(w.proc.is_alive() for w in s._pool) and len(pids) == 4 and not pids & first  # every hung one replaced
  np.testing.assert_array_equal(score(s, ["ok"] * 6), [1] * 6)  # the replaced pool scores at full speed
  s.close()
  assert not s._pool


def test_raising_dying_and_non_finite_rewards_count_as_errors():
  s = scorer()
  np.testing.assert_array_equal(score(s, ["raise", "die", "nan", "inf", "1e39", "ok"]), [0, 0, 0, 0, 0, 1])
  assert s.errors == 5 and all(w.proc.is_alive() for w in s._pool)
  assert math.isfinite(score(s, ["ok", "no"]).sum())
  s.close()


def test_a_batch_where_every_call_failed_stops_the_run_with_the_first_error():
  s = scorer()
  with pytest.raises(
      RewardError, match=r"failed on every sample of a batch; first failure: "
      r"returned nan, not a finite float32 reward"):
    score(s, ["nan", "nan"])
  with pytest.raises(RewardError, match=r"timed out after 0.5s \(rollout.reward_timeout_s\)"):
    s.timeout_s = 0.5
    score(s, ["hang"])
  s.close()
