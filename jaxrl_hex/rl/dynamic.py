"""DAPO dynamic sampling: train only on groups whose rewards differ, sampling more prompts until
the batch holds prompts_per_step of them.

A group whose samples all scored the same has zero advantage under any group baseline, so it
adds no gradient and dilutes the batch. The rollout side feeds every scored rollout to add();
once enough informative groups have arrived it returns a full batch. After max_rounds rollouts
the batch is topped up with uninformative groups, so a task that is solved (or hopeless) for
every prompt cannot stall the run.
"""
import numpy as np

from jaxrl_hex.data.rollouts import concat_rollouts, select_rows


class GroupFilter:

  def __init__(self, prompts_per_step: int, max_rounds: int):
    self.need, self.max_rounds = prompts_per_step, max_rounds
    self._reset()

  def _reset(self):
    self._kept, self._dropped, self.rounds = [], [], 0

  def add(self, rollout):
    """A scored rollout -> (batch Rollout, stats) when the batch is full, else None."""
    self.rounds += 1
    for g in dict.fromkeys(rollout.group_ids.tolist()):  # groups in order of arrival
      rows = np.nonzero(rollout.group_ids == g)[0]
      rewards = rollout.rewards[rows]
      (self._kept if rewards.max() > rewards.min() else self._dropped).append(select_rows(rollout, rows))
    if len(self._kept) < self.need and self.rounds < self.max_rounds:
      return None
    groups = (self._kept + self._dropped)[:self.need]
    batch = concat_rollouts(groups)
    # ids unique within the batch: a prompt drawn again in a later round is another group
    batch.group_ids = np.repeat(np.arange(len(groups)), [len(g.group_ids) for g in groups])
    seen = len(self._kept) + len(self._dropped)
    stats = {
        "dynamic_sampling_rounds": self.rounds,
        "informative_group_fraction": len(self._kept) / seen,
        "uninformative_groups_used": max(self.need - len(self._kept), 0)
    }
    self._reset()
    return batch, stats
