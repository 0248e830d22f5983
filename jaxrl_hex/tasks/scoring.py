"""Calls a task's reward function safely: a reward that raises or hangs scores 0 and is counted,
and a batch where every call failed stops the run with the first error."""
import concurrent.futures
import logging

import numpy as np

from jaxrl_hex.errors import UserError


class RewardError(UserError):
  pass


class RewardScorer:

  def __init__(self, task, timeout_s: float, workers: int = 4):
    self.task, self.timeout_s = task, timeout_s
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="reward")
    self.errors = 0
    self._warned = False

  def __call__(self, prompts, completions, answers) -> np.ndarray:
    futures = [self._pool.submit(self.task.reward, p, c, a) for p, c, a in zip(prompts, completions, answers)]
    rewards, failures = np.zeros(len(futures), np.float32), []
    for i, f in enumerate(futures):
      try:
        rewards[i] = float(f.result(timeout=self.timeout_s))
      except concurrent.futures.TimeoutError:
        failures.append(f"timed out after {self.timeout_s}s (rollout.reward_timeout_s)")
      except Exception as e:  # a user's reward function: any failure is that sample's, not the run's
        failures.append(f"{type(e).__name__}: {e}")
    self.errors += len(failures)
    if failures and len(failures) == len(futures):
      raise RewardError(f"task {self.task.name!r}: the reward function failed on every sample of a batch; "
                        f"first failure: {failures[0]}")
    if failures and not self._warned:
      logging.warning("task %r: reward failed on %d/%d samples (scored 0): %s", self.task.name, len(failures),
                      len(futures), failures[0])
      self._warned = True
    return rewards
