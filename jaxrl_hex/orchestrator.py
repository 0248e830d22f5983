"""The asynchronous RL loop, the same for every backend.

  prompt stream -> rollout.generate -> reward -> buffer (staleness gate) -> train.step
       ^                                                                      |
       +----------- handle of the newest weights <------- train.publish() <---+

Rollout runs in this process's threads (one per rollout replica) and only drives the rollout
side; the trainer loop drives the train side. Where the pools actually compute (device subsets
here, or Ray actors with their own runtimes) is the sides' business (jaxrl_hex/cluster).
"""
import math
import os
import sys
import threading
import time

import numpy as np

from jaxrl_hex.data.prompts import PromptStream
from jaxrl_hex.data.rollouts import decode_completions
from jaxrl_hex.errors import ConfigError, RunStopped
from jaxrl_hex.evaluation import score
from jaxrl_hex.metrics import Progress, thread_stacks
from jaxrl_hex.rl.batch import rl_batch
from jaxrl_hex.rl.buffer import Buffer, Closed, Item
from jaxrl_hex.rl.dynamic import GroupFilter
from jaxrl_hex.rollout.episodes import episode_stats
from jaxrl_hex.sync.probe import check as check_probe, tolerance_for
from jaxrl_hex.tasks import episode_prompt, is_episodic
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
    self.episodic = is_episodic(rt.task)  # an environment's or an agent's episodes come back scored
    self.scorer = None if self.episodic else RewardScorer(rt.task, cfg.rollout.reward_timeout_s)
    self.best = self._resumed_best(meta.get("best"))  # train.keep_best: the best evaluation so far
    self.eval_records = list(rt.task.eval[:cfg.train.eval_size])
    first = (rt.task.eval or rt.task.train)[0]
    # the fixed sequence of sync/probe.py
    self.probe_prompt = episode_prompt(rt.task, first) if self.episodic else first["prompt"]
    self._handle = None  # newest published weights; a rollout started after admit(k) sees >= k - eta
    self._stop = threading.Event()
    self._stream_lock = threading.Lock()  # dynamic sampling draws prompts from rollout threads too
    self.stop_reason = None  # set by request_stop (a signal): checkpoint at the next step boundary, then stop
    self._progress_at = time.time()  # the last train step done or batch generated (the watchdog's clock)
    self._doing = "starting"  # what the train loop waits on, for the watchdog's line
    self._stalled = False
    self._finished = threading.Event()
    self._faults = {}  # an environment's tool errors and episode faults, counted since the run (re)started

  def request_stop(self, reason: str):
    """Asks the train loop to stop: the step in flight finishes (a wait for a batch ends at once),
    a checkpoint of it is written and run() raises RunStopped saying how to resume. Safe to call
    from a signal handler: it only sets a field the loop polls."""
    self.stop_reason = reason

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
    if self.episodic:
      return rollout, receive_span, dict(routed, **episode_stats(rollout)), t1
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
      self._progress_at = time.time()
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
    self._probe()  # a wrong engine shows before any step
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
    if start_step == 0:  # a resumed run's step start_step has its row already; its next row says it resumed
      self.recorder.log(first)
    progress.update(start_step, first)
    thread = threading.Thread(target=self._rollout_loop, name="rollout", daemon=True)
    thread.start()
    if cfg.train.watchdog_s > 0:
      self._progress_at = time.time()
      threading.Thread(target=self._watch, name="watchdog", daemon=True).start()
    acc, nonfinite, saved, item = acc_start, 0, start_step, None
    try:
      for step in range(start_step, self.total_steps):
        t0 = time.time()
        self._doing = f"waiting for batch {step} from the rollout side"
        taken = self._take()
        if taken is None:
          break
        item, staleness = taken
        self._doing = f"in train step {step + 1}"
        row = self._train_on(item, staleness, step, t0)
        self._progress_at = time.time()
        nonfinite = nonfinite + 1 if row.get("nonfinite_updates", 0) >= cfg.algo.minibatches else 0
        if nonfinite >= cfg.train.max_nonfinite_steps:
          self.recorder.log(dict(row, wall_s=time.time() - self.recorder.t0))
          raise RunStopped(f"train step {step + 1}: {nonfinite} steps in a row had a non-finite loss or gradient "
                           f"(train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}), so their updates were "
                           "skipped and the checkpoints hold the last finite weights; lower --config.optim.lr or "
                           "check the reward, then continue with --resume")
        if step == start_step:
          self._check_best_metric(row)
        best = False
        if (step + 1) % cfg.train.eval_every == 0 or step + 1 == self.total_steps:
          acc = row["eval_accuracy"] = self._eval()
          best = self._new_best(step + 1, row)
        if best or (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == self.total_steps:
          self._save(item)
          saved = train.version
        row["wall_s"] = time.time() - self.recorder.t0
        if step == start_step > 0:
          row["resumed_from"] = start_step
        self.recorder.log(row)
        progress.update(step + 1, row)
        if self.stop_reason:
          break
    finally:
      self._stop.set()
      self.buffer.close()
      thread.join(timeout=10.0 if self._stalled else None)  # a stuck rollout thread stays behind (daemon)
      if self.scorer is not None:
        self.scorer.close()
      self._finished.set()
    if self.stop_reason:
      if train.version > saved:  # the steps since the last checkpoint are kept too
        self._save(item)
        saved = train.version
      raise RunStopped(f"stopped by {self.stop_reason} at step {train.version} (checkpoint {saved} written); "
                       "continue with the same command and --resume"
                       if saved else f"stopped by {self.stop_reason} before any checkpoint; start the run again")
    seconds = time.time() - t_start
    summary = {
        "steps": self.total_steps - start_step,
        "eval_accuracy_start": acc_start,
        "eval_accuracy_end": acc,
        "seconds": seconds,
        "dropped_stale": self.buffer.dropped,
        "reward_errors": self.reward_errors,
        "rollout_restarts": self.rollout.restarts,
        "best": self.best
    }
    if acc_start is not None:
      progress.close(f"train: eval accuracy {acc_start:.3f} -> {acc:.3f} over "
                     f"{summary['steps']} RL steps in {seconds:.0f}s")
    return summary

  def _watch(self):
    """The watchdog: once neither side has made progress (a train step, a generated batch) for
    train.watchdog_s, every thread's stack (and each Ray worker's) goes to WORKDIR/stacks.txt and
    the run stops like on a signal, naming what it waited on; a train loop stuck inside a step
    cannot stop, so 60 s later the process ends with exit status 3."""
    limit = self.cfg.train.watchdog_s
    while not self._stop.wait(min(1.0, limit / 4)):
      idle = time.time() - self._progress_at
      if idle < limit:
        continue
      path = os.path.join(self.recorder.workdir, "stacks.txt")
      with open(path, "w") as f:
        f.write(f"# no progress for {idle:.0f}s; the train loop: {self._doing}\n\n# driver\n{thread_stacks()}")
        for name, text in {**self.train.stacks(), **self.rollout.stacks()}.items():
          f.write(f"\n# {name}\n{text}")
      self._stalled = True
      self.stop_reason = (f"the watchdog: no train step or rollout batch for {idle:.0f}s (train.watchdog_s="
                          f"{limit:g}) while {self._doing}; every thread's stack is in {path}")
      if not self._finished.wait(60.0):
        print(
            f"jaxrl-hex: error: stopped by {self.stop_reason}; the train loop did not stop, so no checkpoint "
            "was written: --resume continues from the last one", file=sys.stderr, flush=True)
        os._exit(3)
      return

  def _take(self):
    """The next batch and its staleness (Buffer.take), or None once a stop was requested."""
    while self.stop_reason is None:
      try:
        return self.buffer.take(timeout=0.25)
      except TimeoutError:
        continue
    return None

  def _save(self, item):
    """A checkpoint of the trainer after the step that trained `item`, with the best evaluation so far
    (whose checkpoint the Checkpointer keeps beside the last K; a resume goes on comparing with it)."""
    self.train.save({
        "phase": "train",
        "policy_version": self.train.version,
        "next_batch": item.batch_index + 1,
        "data_state": item.data_state,
        "seed": self.cfg.seed,
        "best": self.best
    })

  def _resumed_best(self, best):
    """A resumed run's best, from its checkpoint, where it was judged as this run judges (keep_best on,
    the same metric and mode)."""
    t = self.cfg.train
    if not t.keep_best or not best or (best.get("metric"), best.get("mode")) != (t.keep_best_by, t.keep_best_mode):
      return None
    return best

  def _check_best_metric(self, row):
    """train.keep_best_by against the first train row, rather than at the first evaluation."""
    t = self.cfg.train
    if t.keep_best and t.keep_best_by != "eval_accuracy" and not isinstance(row.get(t.keep_best_by), (int, float)):
      numeric = sorted(k for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
      raise ConfigError(f"train.keep_best_by={t.keep_best_by!r} is not a number in the train rows; use eval_accuracy "
                        f"or one of {', '.join(numeric)}")

  def _new_best(self, step, row) -> bool:
    """Whether this evaluation beats every earlier one on train.keep_best_by (ties keep the earlier
    checkpoint); if so it is the best now."""
    t = self.cfg.train
    value = row.get(t.keep_best_by)
    if not t.keep_best or not isinstance(value, (int, float)) or not math.isfinite(value):
      return False
    if self.best is not None:
      better = value > self.best["value"] if t.keep_best_mode == "max" else value < self.best["value"]
      if not better:
        return False
    self.best = {"step": step, "metric": t.keep_best_by, "mode": t.keep_best_mode, "value": float(value)}
    return True

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
    if self.cfg.sync.probe_every and train.version % self.cfg.sync.probe_every == 0:
      m = dict(m, probe_gap=self._probe())
    for key in ("tool_errors", "episode_faults"):  # per batch in item.stats; the rows count them from the start
      if key in item.stats:
        self._faults[key] = self._faults.get(key, 0) + item.stats[key]
    values, counts = np.unique(staleness, return_counts=True)
    return dict(m, phase="train", step=step + 1, policy_version=train.version, batch=item.batch_index,
                prompt_ids=sorted({int(g) for g in ro.group_ids}), staleness_mean=float(staleness.mean()),
                staleness_max=int(staleness.max()), staleness_hist={
                    int(v): int(c) for v, c in zip(values, counts)
                }, wait_seconds=t0 - t_wait, sync_seconds=train.sync_seconds, reward_errors=self.reward_errors,
                rollout_restarts=self.rollout.restarts, **dict(item.stats, **self._faults))

  @property
  def reward_errors(self) -> int:
    return self.scorer.errors if self.scorer is not None else 0

  def _probe(self) -> float | None:
    """The weight-sync probe (sync/probe.py) of the newest weights on every rollout replica -> the
    largest logprob gap; a gap over sync.probe_tolerance (a 16-bit float's rounding gap where
    larger, probe.tolerance_for) stops the run. Between a publish and the next step, so the
    trainer holds the version the engines decode with."""
    if not self.cfg.sync.probe_every:
      return None
    t0, gaps = time.time(), []
    allowed = tolerance_for(self.cfg.sync.probe_tolerance, self.cfg.model.dtype)
    for probe in self.rollout.probe(self.probe_prompt, self._handle):
      if probe["version"] != self.train.version:
        continue  # a replica already past it (cannot happen between a publish and a step)
      ro = probe["rollout"]
      mask = ro.completion_mask[0]
      engine_logp, trainer_logp = ro.behaviour_logprobs[0][mask], self.train.score(ro)[0][mask]
      theirs = probe["fingerprint"]
      gaps.append(
          check_probe(self.train.version, engine_logp, trainer_logp, allowed, lambda theirs=theirs:
                      (self.train.fingerprint(always=True), theirs)))
    self.recorder.span("train", "probe", t0, time.time(), version=self.train.version)
    return max(gaps, default=None)

  def _eval(self):
    """Greedy accuracy of the newest published weights, generated on the rollout side."""
    out = self.rollout.evaluate(self.eval_records, self._handle)  # an environment's episodes come back scored
    return float(np.mean(out)) if self.episodic else score(self.scorer, self.eval_records, out)
