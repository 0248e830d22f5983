"""Calls a task's reward function safely: a reward that raises, hangs or returns a non-finite
number scores 0 and is counted, and a batch where every call failed stops the run with the first
error.

Rewards run isolated (tasks/isolated.py: worker processes forked from this one, so a task's reward
closure needs no pickling). A call past rollout.reward_timeout_s has its process killed and
replaced: a hung reward costs one sample's score, never a worker. The reward must not use JAX (a
forked child cannot run it).
"""
import functools
import logging
import math
import threading

import numpy as np

from jaxrl_hex.errors import UserError
from jaxrl_hex.tasks.isolated import IsolatedPool

FLOAT32_MAX = float(np.finfo(np.float32).max)  # rewards are float32: a larger one would be inf


class RewardError(UserError):
  pass


def _reward_value(reward, prompt, completion, answer) -> float:
  return float(reward(prompt, completion, answer))


class RewardScorer:

  def __init__(self, task, timeout_s: float, workers: int = 4):
    self.task, self.timeout_s = task, timeout_s
    self._pool = IsolatedPool(functools.partial(_reward_value, task.reward), workers, "reward")
    self._lock = threading.Lock()  # the counters: rollout threads and the eval score at once
    self.errors = 0
    self._warned = False

  def __call__(self, prompts, completions, answers) -> np.ndarray:
    outcomes = self._pool.run(list(zip(prompts, completions, answers)), self.timeout_s)
    rewards, failures = np.zeros(len(outcomes), np.float32), []
    for i, o in enumerate(outcomes):
      error = o.error
      if o.kind == "timeout":
        error = f"timed out after {self.timeout_s}s (rollout.reward_timeout_s); its process was replaced"
      elif error is None and not (math.isfinite(o.value) and abs(o.value) <= FLOAT32_MAX):
        error = f"returned {o.value!r}, not a finite float32 reward"
      if error is None:
        rewards[i] = o.value
      else:
        failures.append(error)
    every = bool(failures) and len(failures) == len(rewards)
    with self._lock:
      self.errors += len(failures)
      warn = bool(failures) and not every and not self._warned
      self._warned |= warn
    if every:
      raise RewardError(f"task {self.task.name!r}: the reward function failed on every sample of a batch; "
                        f"first failure: {failures[0]}")
    if warn:
      logging.warning("task %r: reward failed on %d/%d samples (scored 0): %s", self.task.name, len(failures),
                      len(rewards), failures[0])
    return rewards

  def close(self):
    self._pool.close()
