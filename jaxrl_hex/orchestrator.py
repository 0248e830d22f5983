"""The asynchronous RL loop, the same for every backend.

  prompt stream -> rollout.generate -> reward -> buffer (staleness gate) -> train.step
       ^                                                                      |
       +----------- handle of the newest weights <------- train.publish() <---+

Rollout runs in this process's threads (one per rollout replica) and only drives the rollout
side; the trainer loop drives the train side. Where the pools actually compute (device subsets
here, or Ray actors with their own runtimes) is the sides' business (jaxrl_hex/cluster).
"""
import threading
import time

import numpy as np

from jaxrl_hex.data.prompts import PromptStream
from jaxrl_hex.data.rollouts import decode_completions
from jaxrl_hex.evaluation import score
from jaxrl_hex.metrics import Progress
from jaxrl_hex.rl.batch import rl_batch
from jaxrl_hex.rl.buffer import Buffer, Closed, Item
from jaxrl_hex.rl.dynamic import GroupFilter
from jaxrl_hex.tasks.scoring import RewardScorer


class Orchestrator:

  def __init__(self, rt, train, rollout, recorder):
    cfg = rt.cfg
    self.rt, self.cfg, self.train, self.rollout, self.recorder = rt, cfg, train, rollout, recorder
    self.total_steps = cfg.train.steps
    meta = train.meta
    self.next_batch = meta.get("next_batch", 0)
    self.buffer = Buffer(cfg.train.max_staleness, train.version, next_batch=self.next_batch)
    self.stream = PromptStream(rt.task.train, cfg.rollout.prompts_per_step, seed=cfg.seed)
    if meta.get("data_state") is not None:
      self.stream.set_state(meta["data_state"])
    self.scorer = RewardScorer(rt.task, cfg.rollout.reward_timeout_s)
    self.eval_records = list(rt.task.eval[:cfg.train.eval_size])
    self._handle = None  # newest published weights; a rollout started after admit(k) sees >= k - eta
    self._stop = threading.Event()
    self._stream_lock = threading.Lock()  # dynamic sampling draws prompts from rollout threads too

  # ---- rollout side -------------------------------------------------------------------------
  def _rollout_loop(self):
    """Admits batch k through the gate, draws its prompts, hands it to a free replica."""
    slots = threading.Semaphore(self.rollout.replicas)
    workers = []
    try:
      k = self.next_batch
      while not self._stop.is_set() and k < self.total_steps:
        if not self.buffer.admit(k, timeout=0.5):
          continue
        if not slots.acquire(timeout=0.5):
          continue
        with self._stream_lock:
          records, data_state = self.stream.next()
        worker = threading.Thread(target=self._produce, args=(k, records, data_state, self._handle, slots),
                                  name=f"rollout-{k}", daemon=True)
        worker.start()
        workers.append(worker)
        k += 1
    except Closed:
      pass
    except BaseException as e:  # surfaces in the trainer thread, which waits on the buffer
      self.buffer.close(e)
    for w in workers:
      w.join()

  def _generate_scored(self, records, index, handle, generated=None):
    group = self.cfg.rollout.group_size
    rollout, receive_span, routed = self.rollout.generate(records, group, self.cfg.seed, index, handle)
    t1 = time.time()
    if generated is not None:
      generated()  # the replica takes the next batch while this one is scored
    completions = decode_completions(self.rt.tokenizer, rollout)
    rollout.rewards = self.scorer([r["prompt"] for r in records for _ in range(group)], completions,
                                  [r["answer"] for r in records for _ in range(group)])
    return rollout, receive_span, routed, t1

  def _produce(self, k, records, data_state, handle, slots):
    released = False

    def free_replica():
      nonlocal released
      if not released:
        released = True
        slots.release()

    try:
      t0 = time.time()
      # dynamic sampling may generate again for this batch: it keeps the replica until done
      rollout, receive_span, routed, t1 = self._generate_scored(
          records, k, handle, None if self.cfg.algo.dynamic_sampling else free_replica)
      stats = {}
      if self.cfg.algo.dynamic_sampling:  # DAPO: draw more prompts until the batch has enough informative groups
        groups = GroupFilter(self.cfg.rollout.prompts_per_step, self.cfg.algo.dynamic_sampling_max_rounds)
        batch = groups.add(rollout)
        while batch is None:
          with self._stream_lock:
            records, data_state = self.stream.next()
          # rng index unique per (batch, round)
          batch = groups.add(self._generate_scored(records, k + groups.rounds * self.total_steps, handle)[0])
        rollout, stats = batch
      t2 = time.time()
      if receive_span is not None:
        self.recorder.span("rollout", "sync", *receive_span, version=handle.version)
      self.recorder.span("rollout", "generate", t0, t1, batch=k, version=int(rollout.oldest_versions().min()))
      self.recorder.span("rollout", "reward", t1, t2, batch=k)
      stats = {"rollout_tokens_per_s": rollout.num_tokens / max(t1 - t0, 1e-9), **routed, **stats}
      self.buffer.put(Item(k, rollout, data_state, stats))
    except Closed:
      pass
    except BaseException as e:
      self.buffer.close(e)
    finally:
      free_replica()

  # ---- train side ---------------------------------------------------------------------------
  def run(self, progress_title="train"):
    """Trains until train.steps; returns the closing summary."""
    cfg, train = self.cfg, self.train
    start_step = train.version
    self._handle = train.publish()
    progress = Progress(progress_title, self.total_steps, cfg.train.log_every)
    progress.last["start_step"] = start_step
    t_start = time.time()
    acc_start = self._eval() if start_step < self.total_steps else None
    first = {
        "phase": "train",
        "step": start_step,
        "policy_version": train.version,
        "eval_accuracy": acc_start,
        "wall_s": time.time() - self.recorder.t0
    }
    self.recorder.log(first)
    progress.update(start_step, first)
    thread = threading.Thread(target=self._rollout_loop, name="rollout", daemon=True)
    thread.start()
    acc = acc_start
    try:
      for step in range(start_step, self.total_steps):
        t0 = time.time()
        item, staleness = self.buffer.take()
        row = self._train_on(item, staleness, step, t0)
        if (step + 1) % cfg.train.eval_every == 0 or step + 1 == self.total_steps:
          acc = row["eval_accuracy"] = self._eval()
        if (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == self.total_steps:
          train.save({
              "phase": "train",
              "policy_version": train.version,
              "next_batch": item.batch_index + 1,
              "data_state": item.data_state,
              "seed": cfg.seed
          })
        row["wall_s"] = time.time() - self.recorder.t0
        self.recorder.log(row)
        progress.update(step + 1, row)
    finally:
      self._stop.set()
      self.buffer.close()
      thread.join()
    seconds = time.time() - t_start
    summary = {
        "steps": self.total_steps - start_step,
        "eval_accuracy_start": acc_start,
        "eval_accuracy_end": acc,
        "seconds": seconds,
        "dropped_stale": self.buffer.dropped,
        "reward_errors": self.scorer.errors,
        "rollout_restarts": self.rollout.restarts
    }
    if acc_start is not None:
      progress.close(f"train: eval accuracy {acc_start:.3f} -> {acc:.3f} over "
                     f"{summary['steps']} RL steps in {seconds:.0f}s")
    return summary

  def _train_on(self, item, staleness, step, t_wait):
    """A train step on a batch from Buffer.take, with its samples' staleness [N] -> the metrics row."""
    train, ro = self.train, item.rollout
    t0 = time.time()
    m = train.step(rl_batch(ro))
    t1 = time.time()
    self._handle = train.publish()
    self.rollout.offer(self._handle)
    t2 = time.time()
    self.buffer.advance(train.version)
    self.recorder.span("train", "step", t0, t1, step=step)
    self.recorder.span("train", "sync", t1, t2, version=train.version)
    values, counts = np.unique(staleness, return_counts=True)
    return dict(m, phase="train", step=step + 1, policy_version=train.version, batch=item.batch_index,
                prompt_ids=sorted({int(g) for g in ro.group_ids}), staleness_mean=float(staleness.mean()),
                staleness_max=int(staleness.max()), staleness_hist={
                    int(v): int(c) for v, c in zip(values, counts)
                }, wait_seconds=t0 - t_wait, sync_seconds=train.sync_seconds, reward_errors=self.scorer.errors,
                rollout_restarts=self.rollout.restarts, **item.stats)

  def _eval(self):
    """Greedy accuracy of the newest published weights, generated on the rollout side."""
    return score(self.scorer, self.eval_records, self.rollout.evaluate(self.eval_records, self._handle))
