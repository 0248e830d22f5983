"""The asynchronous RL loop: a rollout thread on the rollout pool, the trainer on the train pool.

  prompt stream -> engine.generate -> reward -> buffer (staleness gate) -> trainer.step
       ^                                                                      |
       +------------- sync.receive <------- sync.publish(version, params) <---+

The pools only meet in the buffer and the weight sync, so the rollout side can later be a
group of Ray actors without this loop changing.
"""
import threading
import time

import jax
import numpy as np

from jaxrl_hex.data.prompts import PromptStream
from jaxrl_hex.evaluation import evaluate
from jaxrl_hex.metrics import Progress
from jaxrl_hex.rl.batch import rl_batch
from jaxrl_hex.rl.buffer import Buffer, Closed, Item
from jaxrl_hex.rollout.engine import Engine
from jaxrl_hex.tasks.scoring import RewardScorer


class Orchestrator:

  def __init__(self, rt, trainer, sync, recorder, checkpointer, next_batch=0, data_state=None):
    cfg = rt.cfg
    self.rt, self.cfg, self.trainer, self.sync = rt, cfg, trainer, sync
    self.recorder, self.checkpointer = recorder, checkpointer
    self.eta = cfg.train.max_staleness
    self.total_steps = cfg.train.steps
    self.next_batch = next_batch
    self.buffer = Buffer(self.eta, trainer.version)
    self.stream = PromptStream(rt.task.train, cfg.rollout.prompts_per_step, seed=cfg.seed)
    if data_state is not None:
      self.stream.set_state(data_state)
    r = cfg.rollout
    self.engine = Engine(rt.policy, rt.pools["rollout"], rt.tokenizer, r.max_new_tokens,
                         r.temperature, r.top_k, r.top_p)
    self.eval_engine = Engine(rt.policy, rt.pools["train"], rt.tokenizer, r.max_new_tokens)
    self.scorer = RewardScorer(rt.task, r.reward_timeout_s)
    self.eval_records = list(rt.task.eval[:cfg.train.eval_size])
    self.rng = jax.random.key(cfg.seed)
    self._stop = threading.Event()

  # ---- rollout side -------------------------------------------------------------------------
  def _rollout_loop(self):
    try:
      k, group = self.next_batch, self.cfg.rollout.group_size
      while not self._stop.is_set() and k < self.total_steps:
        if not self.buffer.admit(k, timeout=0.5):
          continue
        # batch k may use weights no older than k - eta; wait for them if the sync lags
        while not self.sync.wait_for(k - self.eta, timeout=0.5):
          if self._stop.is_set():
            return
        if self.sync.latest_version() > self.engine.version:
          t0 = time.time()
          version, params = self.sync.receive()
          self.engine.load_weights(version, params)
          self.recorder.span("rollout", "sync", t0, time.time(), version=version)
        records, data_state = self.stream.next()
        t0 = time.time()
        rollout = self.engine.generate([r["prompt"] for r in records], group,
                                       jax.random.fold_in(self.rng, k),
                                       group_ids=[r["index"] for r in records])
        t1 = time.time()
        rollout.rewards = self.scorer([r["prompt"] for r in records for _ in range(group)],
                                      self.engine.decode(rollout),
                                      [r["answer"] for r in records for _ in range(group)])
        t2 = time.time()
        self.recorder.span("rollout", "generate", t0, t1, batch=k, version=self.engine.version)
        self.recorder.span("rollout", "reward", t1, t2, batch=k)
        item = Item(k, rollout, data_state, int(rollout.versions[rollout.completion_mask].min()))
        item.stats = {"rollout_tokens_per_s": rollout.num_tokens / max(t1 - t0, 1e-9)}
        self.buffer.put(item)
        k += 1
    except Closed:
      pass
    except BaseException as e:  # surfaces in the trainer thread, which is waiting on the buffer
      self.buffer.close(e)

  # ---- train side ---------------------------------------------------------------------------
  def run(self, progress_title="train"):
    """Trains until train.steps; returns the closing summary."""
    cfg, trainer = self.cfg, self.trainer
    start_step = trainer.version
    version, params = trainer.weights()
    self.sync.publish(version, params)
    progress = Progress(progress_title, self.total_steps, cfg.train.log_every)
    progress.last["start_step"] = start_step
    t_start = time.time()
    acc_start = self._eval(start_step) if start_step < self.total_steps else None
    first = {"phase": "train", "step": start_step, "policy_version": trainer.version,
             "eval_accuracy": acc_start, "wall_s": time.time() - self.recorder.t0}
    self.recorder.log(first)
    progress.update(start_step, first)
    thread = threading.Thread(target=self._rollout_loop, name="rollout", daemon=True)
    thread.start()
    acc = acc_start
    try:
      for step in range(start_step, self.total_steps):
        t0 = time.time()
        item, _ = self.buffer.take()
        row = self._train_on(item, step, t0)
        if (step + 1) % cfg.train.eval_every == 0 or step + 1 == self.total_steps:
          acc = row["eval_accuracy"] = self._eval(trainer.version)
        if (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == self.total_steps:
          self._checkpoint(item)
        row["wall_s"] = time.time() - self.recorder.t0
        self.recorder.log(row)
        progress.update(step + 1, row)
    finally:
      self._stop.set()
      self.buffer.close()
      thread.join()
      self.checkpointer.wait()
    seconds = time.time() - t_start
    summary = {"steps": self.total_steps - start_step, "eval_accuracy_start": acc_start,
               "eval_accuracy_end": acc, "seconds": seconds, "dropped_stale": self.buffer.dropped,
               "reward_errors": self.scorer.errors}
    if acc_start is not None:
      progress.close(f"train: eval accuracy {acc_start:.3f} -> {acc:.3f} over "
                     f"{summary['steps']} RL steps in {seconds:.0f}s")
    return summary

  def _train_on(self, item, step, t_wait):
    trainer, ro = self.trainer, item.rollout
    # per-sample staleness: trainer version minus the oldest version among its tokens
    oldest = np.where(ro.completion_mask, ro.versions, np.iinfo(np.int32).max).min(axis=1)
    staleness = trainer.version - oldest
    t0 = time.time()
    m = trainer.step(rl_batch(ro))
    t1 = time.time()
    version, params = trainer.weights()
    self.sync.publish(version, params)
    t2 = time.time()
    self.buffer.advance(version)
    self.recorder.span("train", "step", t0, t1, step=step)
    self.recorder.span("train", "sync", t1, t2, version=version)
    values, counts = np.unique(staleness, return_counts=True)
    return dict(m, phase="train", step=step + 1, policy_version=version, batch=item.batch_index,
                staleness_mean=float(staleness.mean()), staleness_max=int(staleness.max()),
                staleness_hist={int(v): int(c) for v, c in zip(values, counts)},
                wait_seconds=t0 - t_wait, sync_seconds=self.sync.last_seconds,
                reward_errors=self.scorer.errors, **item.stats)

  def _eval(self, version):
    return evaluate(self.eval_engine, self.scorer, self.eval_records, version, self.trainer.params,
                    len(self.eval_records))

  def _checkpoint(self, item):
    """After the trainer consumed batch k: resume draws batch k + 1 from where k left the stream."""
    trainer = self.trainer
    state = {"params": trainer.params, "opt_state": trainer.opt_state}
    if trainer.ref_params is not None:
      state["ref_params"] = trainer.ref_params
    self.checkpointer.save(trainer.version, state, {
        "phase": "train", "policy_version": trainer.version, "next_batch": item.batch_index + 1,
        "data_state": item.data_state, "seed": self.cfg.seed})
