"""Calls a task's reward function safely: a reward that raises, hangs or returns a non-finite
number scores 0 and is counted, and a batch where every call failed stops the run with the first
error.

Rewards run in worker processes forked from this one (so a task's reward closure needs no
pickling), one call at a time each. A call past rollout.reward_timeout_s cannot be stopped inside
a thread, so its process is killed and replaced: a hung reward costs one sample's score, never a
worker. The reward must not use JAX (a forked child cannot run it).
"""
import logging
import math
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
import warnings

import numpy as np

from jaxrl_hex.errors import UserError

FLOAT32_MAX = float(np.finfo(np.float32).max)  # rewards are float32: a larger one would be inf


class RewardError(UserError):
  pass


def _serve(conn, reward):
  """A reward process: (index, prompt, completion, answer) in, (index, value, error) out."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  while True:
    try:
      i, prompt, completion, answer = conn.recv()
    except (EOFError, OSError):
      return
    try:
      value, error = float(reward(prompt, completion, answer)), None
    except BaseException as e:  # noqa: BLE001 -- a user's reward: any failure is that sample's
      value, error = None, f"{type(e).__name__}: {e}"
    conn.send((i, value, error))


class _Worker:

  def __init__(self, reward):
    ctx = multiprocessing.get_context("fork")
    self.conn, child = ctx.Pipe()
    self.proc = ctx.Process(target=_serve, args=(child, reward), daemon=True, name="reward")
    with warnings.catch_warnings():  # JAX warns on every fork; the child runs only the reward
      warnings.simplefilter("ignore", RuntimeWarning)
      self.proc.start()
    child.close()
    self.job, self.started = None, 0.0

  def send(self, job):
    self.job, self.started = job, time.monotonic()
    self.conn.send(job)

  def kill(self):
    self.proc.kill()
    self.proc.join()
    self.conn.close()


class RewardScorer:

  def __init__(self, task, timeout_s: float, workers: int = 4):
    self.task, self.timeout_s, self.workers = task, timeout_s, workers
    self._pool = []  # started at the first call
    self._lock = threading.Lock()  # one batch at a time: rollout threads and the eval share the workers
    self.errors = 0
    self._warned = False

  def __call__(self, prompts, completions, answers) -> np.ndarray:
    with self._lock:
      return self._score(prompts, completions, answers)

  def _score(self, prompts, completions, answers) -> np.ndarray:
    jobs = list(zip(range(len(prompts)), prompts, completions, answers))[::-1]
    rewards, failures = np.zeros(len(jobs), np.float32), []
    if not self._pool:
      self._pool = [_Worker(self.task.reward) for _ in range(self.workers)]
    busy = {}
    while jobs or busy:
      for w in self._pool:
        if w.job is None and jobs:
          w.send(jobs.pop())
          busy[w.conn] = w
      wait = min(w.started + self.timeout_s for w in busy.values()) - time.monotonic()
      for conn in multiprocessing.connection.wait(list(busy), timeout=max(wait, 0.0)):
        w = busy.pop(conn)
        try:
          i, value, error = conn.recv()
        except (EOFError, OSError):  # the process died mid-call (the reward killed it, or the OOM killer)
          i, value, error = w.job[0], None, f"its process died (exit code {w.proc.exitcode})"
          self._replace(w)
        w.job = None
        if error is None and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
          error = f"returned {value!r}, not a finite float32 reward"
        if error is None:
          rewards[i] = value
        else:
          failures.append(error)
      now = time.monotonic()
      for conn, w in list(busy.items()):
        if now - w.started >= self.timeout_s:
          del busy[conn]
          failures.append(f"timed out after {self.timeout_s}s (rollout.reward_timeout_s); its process was replaced")
          self._replace(w)
    self.errors += len(failures)
    if failures and len(failures) == len(rewards):
      raise RewardError(f"task {self.task.name!r}: the reward function failed on every sample of a batch; "
                        f"first failure: {failures[0]}")
    if failures and not self._warned:
      logging.warning("task %r: reward failed on %d/%d samples (scored 0): %s", self.task.name, len(failures),
                      len(rewards), failures[0])
      self._warned = True
    return rewards

  def _replace(self, worker):
    worker.kill()
    self._pool[self._pool.index(worker)] = _Worker(self.task.reward)

  def close(self):
    with self._lock:
      for w in self._pool:
        w.kill()
      self._pool = []
