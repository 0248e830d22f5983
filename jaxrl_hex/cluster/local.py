"""Both sides in this JAX runtime. The Ray workers wrap these same classes, one per process."""
import collections
import concurrent.futures
import os
import threading
import time

import jax

from jaxrl_hex.base_weights import first_weights
from jaxrl_hex.checkpoint import Checkpointer
from jaxrl_hex.config import resolve_path
from jaxrl_hex.data.rollouts import select_rows
from jaxrl_hex.evaluation import greedy_completions, greedy_episodes
from jaxrl_hex.rl.batch import scoring_batch
from jaxrl_hex.rl.objectives import make_rl_loss
from jaxrl_hex.rl.trainer import Trainer, make_optimizer
from jaxrl_hex.rollout.engine import Engine, engine_options
from jaxrl_hex.rollout.streams import make_stream
from jaxrl_hex.sync import make_sync
from jaxrl_hex.sync.adapters import AdapterWeights
from jaxrl_hex.sync.direct import rollout_layouts
from jaxrl_hex.sync.fingerprint import check, fingerprint
from jaxrl_hex.tasks import is_episodic, prompt_lengths

ADVANCE_MAX_S = 1.0  # longest a fleet replica's call runs without news (weights arrive beside it)


def batch_key(seed, batch_index):
  """The rng of batch `batch_index`; a prompt group's samples are keyed by it and the group's id."""
  return jax.random.fold_in(jax.random.key(seed), batch_index)


def sync_directory(cfg, workdir):
  return resolve_path(cfg.sync.directory) if cfg.sync.directory else os.path.join(workdir, "sync")


def make_syncs(rt, workdir, receive: bool):
  """(the trained params' sync, the LoRA base's or None): one method, the base in its own place.
  receive: this runtime receives, onto its rollout layout (else it only publishes)."""
  policy, cfg = rt.policy, rt.cfg
  shapes = policy.split(policy.shapes())
  targets = policy.split(rt.shardings("rollout")) if receive else (None, None)
  layouts = ([], [])  # direct within one host: the rollout layouts the train side writes into
  if not receive and cfg.sync.method == "direct" and cfg.sync.transport == "shared_memory":
    for axes, specs in rollout_layouts(rt.mesh_file.pools["rollout"].replica_specs(), policy.logical_axes(),
                                       policy.shapes()):
      for kept, part in zip(layouts, policy.split(specs)):
        kept.append((axes, part))
  directory = sync_directory(cfg, workdir)
  sync = make_sync(cfg.sync.method, shapes[0], targets[0], directory, layouts[0])
  base = make_sync(cfg.sync.method, shapes[1], targets[1], os.path.join(directory, "base"), layouts[1],
                   slots=1) if policy.lora else None  # the base: published once, held for good
  return sync, base


class LocalTrainSide:
  """The trainer on the train pool, started from a checkpoint, init_from, or a warm start."""

  def __init__(self, rt, workdir, resume, recorder, sync, base_sync=None):
    """base_sync: with LoRA, where the frozen base is published (once)."""
    cfg = rt.cfg
    self.rt, self.sync, self.base_sync, self._base_handle = rt, sync, base_sync, None
    self._settle_seconds = 0.0  # what the last step waited for the publish before it
    self.checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), cfg.train.keep_checkpoints)
    self.meta = {}
    params, self.warmstart = first_weights(rt, workdir, resume, recorder)
    kl = cfg.algo.kl_coef > 0  # a frozen reference: a copy of the start, or with LoRA the base itself
    ref = jax.tree.map(lambda x: x.copy(), params) if kl and not rt.policy.lora else None
    updates = cfg.train.steps * cfg.algo.minibatches  # the schedule counts optimizer updates
    self.trainer = Trainer(rt.policy, rt.pool("train"), make_optimizer(cfg.optim, updates),
                           make_rl_loss(cfg.algo, cfg.rollout.temperature), params, ref_params=ref, base_reference=kl)
    if resume:
      step = cfg.train.get("resume_step", -1)
      restored, self.meta = self.checkpointer.restore(self._state(), None if step < 0 else step)
      self.trainer.load_state(restored, self.meta["policy_version"])
      if jax.process_index() == 0:  # later steps (damaged, or past --step) would collide with the new saves
        self.checkpointer.supersede(self.meta["policy_version"])

  @property
  def version(self) -> int:
    return self.trainer.version

  def _state(self):
    return self.trainer.state()  # params, opt_state, and ref_params / critic when the algorithm has them

  def step(self, batch) -> dict:
    # the params are donated to this step: a publish's copy of them still running must end first
    self._settle_seconds = self.sync.settle() + (self.base_sync.settle() if self.base_sync else 0.0)
    return self.trainer.step(batch)

  def publish(self):
    """The trained params' Handle (with LoRA the adapters', carrying the base's Handle)."""
    handle = self.sync.publish(*self.trainer.weights())
    return handle._replace(fingerprint=self.fingerprint(), base=self.publish_base())

  def publish_base(self):
    """With LoRA, the frozen base published once -> its Handle; else None."""
    if self.base_sync is not None and self._base_handle is None:
      self._base_handle = self.base_sync.publish(0, self.trainer.frozen)
    return self._base_handle

  def fingerprint(self, always=False):
    """The params' sync.fingerprint on versions sync.verify_every says to check (or always), else None."""
    every = self.rt.cfg.sync.verify_every
    due = always or (every and self.trainer.version % every == 0)
    return fingerprint(self.trainer.params) if due else None

  def score(self, rollout):
    """[N, C] logprobs of the rollout's completion tokens under the current params (the probe)."""
    return self.trainer.score(scoring_batch(rollout))

  @property
  def sync_seconds(self) -> float:
    """What the trainer waited on sync this step: the publish, and the previous publish's copy
    where the step had to wait for it."""
    return self.sync.last_seconds + self._settle_seconds

  def save(self, meta: dict):
    self.checkpointer.save(self.trainer.version, self._state(), meta)

  def describe(self) -> dict:
    return dict(self.rt.pool("train").describe(), processes=[{"pid": os.getpid(), "host": os.uname().nodename}])

  def stacks(self) -> dict:
    return {}  # its threads are the driver's (metrics.thread_stacks)

  def close(self):
    self.checkpointer.close()
    for sync in (self.sync, self.base_sync):
      if sync is not None:
        sync.close()


class LocalRolloutSide:
  """The engine on the rollout pool, pulling weights from the sync whenever a newer version exists."""
  replicas = 1
  restarts = 0

  def __init__(self, rt, sync, base_sync=None):
    """base_sync: with LoRA, where the frozen base arrives from (once); the adapters come by `sync`."""
    r = rt.cfg.rollout
    self.rt, self.sync, self.base_sync = rt, sync, base_sync
    self.lora_weights = AdapterWeights(rt.policy, rt.shardings("rollout"), r.lora_serving) if rt.policy.lora else None
    policy = self.lora_weights.engine_policy if self.lora_weights else rt.policy
    self._offered = None  # newest published weights, received in the background (offer)
    # double-buffered receive: the engine decodes on its weights while the next version lands in
    # a second set of buffers, then switches at a step boundary (Engine.load_weights)
    self._landing = None  # (version, Future) of the background receive of the newest offered
    self._receiver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights-receive")
    self._received = (-1, None)  # (version, engine params) last received: this runtime's engines share them
    self._receive_lock = threading.Lock()
    pool = rt.pool("rollout")
    options = engine_options(r)
    self.engine = Engine(policy, pool, rt.tokenizer, r.max_new_tokens, r.temperature, r.top_k, r.top_p, **options)
    self.eval_engine = Engine(policy, pool, rt.tokenizer, r.max_new_tokens, **options)
    # a fleet replica's routed chunks (advance): prompt groups, or an environment's episodes
    self.episodic = is_episodic(rt.task)
    self.stream = make_stream(self.engine, rt.task, r.turn_tokens)
    self.eval_stream = make_stream(self.eval_engine, rt.task, r.turn_tokens) if self.episodic else None
    self._arrived = threading.Event()  # set by notify(): the router holds new work for this replica
    self.receives = collections.deque(maxlen=64)  # (start, end) of the receives that landed beside decoding

  def warmup(self, sample: int = 1000) -> float:
    """Compiles the engine's programs for the task's prompt lengths (a sample of its training
    prompts) before the replica takes work -> seconds."""
    records = self.rt.task.train
    step = max(1, len(records) // sample)
    lengths = list(prompt_lengths(self.rt.task, [records[i] for i in range(0, len(records), step)]))
    return self.engine.warmup(lengths, self.rt.cfg.rollout.group_size)

  def notify(self):
    """New work for this replica is waiting (a batch arrived): a running advance() returns at its
    next hand-back, so the caller can queue it, instead of running on with slots idle."""
    self._arrived.set()

  def offer(self, handle):
    """Called right after each publish: the weights are received in the background while the
    engine decodes on its own, and in-flight sequences switch to them at the engine's next
    hand-back (rollout.interrupt), each new token carrying the new version."""
    if self._offered is None or handle.version > self._offered.version:
      self._offered = handle
      self._landing = (handle.version, self._receiver.submit(self._land, handle))

  def _land(self, handle):
    if handle is not self._offered:
      return  # superseded while queued: the newer one lands instead
    start = time.time()
    weights = self._weights(handle)
    self.receives.append((start, time.time()))
    self.engine.load_weights(*weights)  # now if the engine is idle, else at its next step boundary

  def _wait_landing(self, version=None):
    """Waits for the background receive when it brings `version` or newer (None: if it is done),
    raising what it raised (a failed fingerprint check)."""
    landing = self._landing
    if landing is not None and (landing[1].done() if version is None else landing[0] >= version):
      landing[1].result()

  def refresh(self, engine, handle):
    """Loads `handle`'s weights into `engine` unless it has them or newer; -> (start, end) of the
    wait (a background receive of them finishing, or a receive now) or None."""
    self._wait_landing()  # a failed background receive (a fingerprint mismatch) surfaces here
    if handle.version <= engine.version:
      return None
    start = time.time()
    self._wait_landing(handle.version)
    if handle.version > engine.version:
      engine.load_weights(*self._weights(handle))
    return start, time.time()

  def _weights(self, handle):
    """(version, the engine's params) of `handle` or newer: the last received when it is, else received now."""
    with self._receive_lock:
      if self._received[0] < handle.version:
        self._received = self._receive(handle)
      return self._received

  def _receive(self, handle):
    """(version, the engine's params) of `handle` in this runtime's layout, checked against its
    fingerprint; with LoRA the base first where this runtime lacks it, then the adapters on it."""
    if self.lora_weights is not None and self.lora_weights.needs_base(handle):
      self.lora_weights.set_base(handle.base, self.base_sync.receive(handle.base)[1])
    version, params = self.sync.receive(handle)
    if handle.fingerprint is not None:
      check(handle.fingerprint, params, version)
    return version, (params if self.lora_weights is None else self.lora_weights.assemble(version, params))

  def received(self, engine):
    """The weights `engine` runs as the trainer published them (with LoRA its adapters)."""
    return engine.params if self.lora_weights is None else self.lora_weights.adapters[1]

  def generate(self, records, group_size, seed, batch_index, handle):
    """-> (Rollout, receive span or None, {} (one runtime: no per-replica figures)). Weights are at
    least handle.version. An environment's Rollout holds its episodes, rewards included."""
    span = self.refresh(self.engine, handle)
    key, ids = batch_key(seed, batch_index), [r["index"] for r in records]
    if self.episodic:
      return self.stream.run(records, group_size, key, ids)[0], span, {}
    rollout = self.engine.generate([r["prompt"] for r in records], group_size, key, group_ids=ids)
    return rollout, span, {}

  def advance(self, chunks, handle) -> dict:
    """A fleet replica's step: queues `chunks` [(id, records, group_size, seed, batch_index)] on
    the running engine, then hand-backs until a chunk finishes or the engine has room for more
    -> {done: [(id, Rollout)], tokens generated, decode steps run and their seconds, receives:
    [(start, end)] the engine waited for weights, landed: [(start, end)] of receives beside
    decoding}. Weights are at least handle.version for every queued group: they are waited for
    only when they have not landed yet (the engine switches before it admits); a group's samples
    are those generate() would draw."""
    self.offer(handle)
    waited = self.refresh(self.engine, handle) if chunks else self._wait_landing()
    for cid, records, group_size, seed, batch_index in chunks:
      self.stream.submit(cid, records if self.episodic else [r["prompt"] for r in records], group_size,
                         batch_key(seed, batch_index), [r["index"] for r in records])
    engine = self.engine
    tokens, steps, decode_s = engine.tokens_generated, engine.decode_steps, engine.decode_seconds
    done = self.stream.advance(max_s=ADVANCE_MAX_S, group_size=self.rt.cfg.rollout.group_size,
                               arrived=self._arrived.is_set)
    # cleared on the way out, not in: a notify that lands between the caller's last look at the
    # router and this call is for work this call did not take, so it ends the call at once
    self._arrived.clear()
    landed = [self.receives.popleft() for _ in range(len(self.receives))]
    return {
        "done": done,
        "tokens": engine.tokens_generated - tokens,
        "steps": engine.decode_steps - steps,
        "decode_s": engine.decode_seconds - decode_s,
        "receives": [waited] if waited else [],
        "landed": landed
    }

  def evaluate(self, records, handle) -> list:
    """Greedy completions (str) of the records, to score; an environment's greedy episodes' rewards (float)."""
    self.refresh(self.eval_engine, handle)
    if self.episodic:
      return greedy_episodes(self.eval_stream, records)[0].tolist()
    return greedy_completions(self.eval_engine, records, len(records))

  def probe(self, prompt, handle) -> list[dict]:
    """The weight-sync probe (sync/probe.py): `prompt` greedy-decoded with the weights of `handle`
    -> [{version, rollout: its one row, fingerprint: of the weights the engine decoded with}], one
    per replica."""
    engine = self.eval_engine
    self.refresh(engine, handle)
    rollout = engine.generate([prompt] * engine.pool.batch_ways, 1, jax.random.key(0), greedy=True)
    return [{
        "version": engine.version,
        "rollout": select_rows(rollout, [0]),
        "fingerprint": fingerprint(self.received(engine))
    }]

  def describe(self) -> dict:
    return dict(self.rt.pool("rollout").describe(), processes=[{"pid": os.getpid(), "host": os.uname().nodename}])

  def stacks(self) -> dict:
    return {}

  def close(self):
    self._receiver.shutdown(wait=False, cancel_futures=True)
    if self.episodic:
      self.stream.close()
      self.eval_stream.close()


def local_sides(rt, workdir, resume, recorder):
  syncs = make_syncs(rt, workdir, receive=True)
  return LocalTrainSide(rt, workdir, resume, recorder, *syncs), LocalRolloutSide(rt, *syncs)
