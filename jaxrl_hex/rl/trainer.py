"""The learner: params and optimizer state on the train pool, and the step that updates them.

A step lays the batch out into micro-batches (rl.packing, on the host), runs the objective's
start pass once on the whole batch (advantages, loss weights, reference / proximal / critic
forward passes), then takes one optimizer update per minibatch, accumulating gradients over its
micro-batches inside one jitted call. What is optimised is an objective (rl.objectives); the
trainer only owns state, shardings and the policy version. It never imports the engine.

With LoRA (model.lora.rank > 0) what is trained is the adapters alone: `params` are the adapters
(with their optimizer state, checkpointed and published), `frozen` the base, an argument of every
program but never donated, differentiated or copied; the KL reference is the base itself (every
adapter's B zero). Without LoRA `frozen` is empty and `params` is the whole model.
"""
import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_hex.errors import UserError
from jaxrl_hex.models import lora
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.sharding import traced_under
from jaxrl_hex.rl import packing
from jaxrl_hex.rl.batch import TrainBatch
from jaxrl_hex.rl.layout import Rows, token_logprobs
from jaxrl_hex.rl.objectives import StartInputs


def make_optimizer(optim, total_steps: int):
  """Gradient clipping and AdamW under a linear warmup to optim.lr and a cosine decay to
  lr * end_lr_ratio at total_steps (optax.adamw with optax.warmup_cosine_decay_schedule), the
  schedule's settings held in the optimizer state (scale_by_warmup_cosine)."""
  end = optim.lr * optim.end_lr_ratio
  settings = dict(lr=optim.lr, warmup=min(optim.warmup_steps, max(total_steps - 1, 1)), decay=max(total_steps, 2),
                  alpha=end / optim.lr if optim.lr else 0.0)  # alpha as optax computes it, in float64
  adamw = optax.chain(optax.scale_by_adam(b1=optim.b1, b2=optim.b2), optax.add_decayed_weights(optim.weight_decay),
                      scale_by_warmup_cosine(settings))
  return optax.chain(optax.clip_by_global_norm(optim.grad_clip), adamw)


class ScheduleState(NamedTuple):
  """scale_by_warmup_cosine's state: the update count and the schedule's settings as fp32 scalars,
  inputs of the update program rather than constants compiled into it, so runs that differ only
  in optim.lr, warmup_steps, end_lr_ratio or train.steps share one compiled update."""
  count: jax.Array  # int32 []
  settings: dict  # lr, warmup, decay, alpha (end lr / lr): fp32 []


def warmup_cosine(count, lr, warmup, decay, alpha):
  """optax.warmup_cosine_decay_schedule(0, lr, warmup, decay, alpha * lr)(count), its settings traced."""
  ramp = lr - lr * (1 - jnp.clip(count, 0, warmup) / jnp.where(warmup > 0, warmup, 1))
  cosine = 0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(count - warmup, decay - warmup) / (decay - warmup)))
  return jnp.where(count < warmup, ramp, lr * ((1 - alpha) * cosine + alpha))


def scale_by_warmup_cosine(settings: dict) -> optax.GradientTransformation:
  """optax.scale_by_learning_rate(warmup_cosine schedule) with the settings in its state."""

  def init(params):
    del params
    return ScheduleState(jnp.zeros([], jnp.int32), {k: jnp.float32(v) for k, v in settings.items()})

  def update(updates, state, params=None):
    del params
    step = -warmup_cosine(state.count, **state.settings)
    return jax.tree.map(lambda g: step.astype(g.dtype) * g, updates), ScheduleState(optax.safe_increment(state.count),
                                                                                    state.settings)

  return optax.GradientTransformation(init, update)


def saved_opt_state(opt_state):
  """The optimizer state as a checkpoint holds it: each ScheduleState as the count alone
  (optax.ScaleByScheduleState, as optax.adamw's schedule keeps it), so checkpoints keep their
  layout and a resumed run takes its schedule from its own config."""
  return jax.tree.map(lambda x: optax.ScaleByScheduleState(x.count)
                      if isinstance(x, ScheduleState) else x, opt_state, is_leaf=lambda x: isinstance(x, ScheduleState))


def loaded_opt_state(saved, current):
  """The inverse of saved_opt_state: the saved counts with the current state's schedule settings."""
  return jax.tree.map(lambda c, s: c._replace(count=s.count) if isinstance(c, ScheduleState) else s, current, saved,
                      is_leaf=lambda x: isinstance(x, ScheduleState))


def critic_model(policy) -> Policy:
  """The critic: the policy's architecture with an untied head whose column 0 is the value."""
  cfg = policy.cfg.copy_and_resolve_references()
  cfg.tie_embeddings = False
  return Policy.build(cfg)


def critic_init(critic, params):
  """Critic params from the policy's: same trunk, zero head (every value starts at 0)."""
  head_shape = critic.shapes()["lm_head"]
  return dict(params, lm_head=jnp.zeros(head_shape.shape, head_shape.dtype))


class Trainer:
  """step(batch) -> metrics; weights() -> (version, params). Version = trainer steps taken."""

  def __init__(self, policy, pool, optimizer, objective, params, ref_params=None, base_reference=False):
    """params: the whole model's (base and adapters). ref_params: a frozen reference for the KL;
    base_reference: with LoRA, the reference is the base (no copy; ref_params must be None)."""
    self.pool, self.tx, self.objective = pool, optimizer, objective
    self.param_shardings, frozen_shardings = policy.split(pool.shardings_for(policy.logical_axes(), policy.shapes()))
    params, frozen = policy.split(params)
    self.params = jax.device_put(params, self.param_shardings)
    self.frozen = jax.device_put(frozen, frozen_shardings)
    self.ref_params = None if ref_params is None else jax.device_put(ref_params, self.param_shardings)
    self._base_reference = base_reference and policy.lora
    opt_shardings = optimizer_shardings(pool, self.tx, self.param_shardings, policy.split(policy.shapes())[0])
    self.opt_state = jax.jit(self.tx.init, out_shardings=opt_shardings)(self.params)
    self.critic = self.critic_params = self.critic_opt_state = self.critic_tx = None
    critic_shardings = critic_opt_shardings = None
    if objective.critic_optimizer is not None:
      self.critic, self.critic_tx = critic_model(policy), objective.critic_optimizer
      critic_shardings = pool.shardings_for(self.critic.logical_axes(), self.critic.shapes())
      self.critic_params = jax.jit(functools.partial(critic_init, self.critic),
                                   out_shardings=critic_shardings)(self.whole())
      critic_opt_shardings = optimizer_shardings(pool, self.critic_tx, critic_shardings, self.critic.shapes())
      self.critic_opt_state = jax.jit(self.critic_tx.init, out_shardings=critic_opt_shardings)(self.critic_params)
    self.version = 0
    state_shardings = (self.param_shardings, opt_shardings, critic_shardings, critic_opt_shardings)
    models = (policy, self.critic)
    self._start = start_program(pool, objective, models)
    self._update = update_program(pool, objective, models, self.tx, self.critic_tx, state_shardings)
    self._gradients = jax.jit(traced_under(pool.activation_sharding, functools.partial(_accumulate, objective, models)),
                              static_argnames=("num_seqs",))
    self._score = jax.jit(traced_under(pool.activation_sharding, functools.partial(token_logprobs, policy)))

  def whole(self, params=None) -> dict:
    """The whole model's params: `params` (default the trained ones) with the frozen base."""
    return lora.merge(self.params if params is None else params, self.frozen)

  def reference(self):
    """The KL reference's params, or None: the stored copy, or with LoRA the base (zero B)."""
    if self._base_reference:
      return self.whole(lora.zeros_like_b(self.params))
    return self.ref_params

  def plan(self, batch: TrainBatch) -> packing.Layout:
    n = batch.tokens.shape[0]
    if n % self.pool.batch_ways:
      raise UserError(f"train batch of {n} sequences does not divide over pool '{self.pool.name}' "
                      f"batch axes ({self.pool.batch_ways} ways); make the batch a multiple of it")
    return layout_of(self.objective, self.pool, batch)

  def _prepare(self, batch: TrainBatch):
    """Host batch -> (layout, its Rows and the objective's TokenData on the pool, start metrics)."""
    layout = self.plan(batch)
    rows, per_seq, slot, minibatch_of = step_inputs(self.pool, layout, batch)
    data, metrics = self._start(
        StartInputs(self.whole(), rows, per_seq, slot, minibatch_of, self.reference(), self.critic_params))
    return layout, rows, data, metrics

  def step(self, batch: TrainBatch) -> dict:
    start = time.perf_counter()
    layout, rows, data, start_metrics = self._prepare(batch)
    metrics = []
    for m in range(layout.shape[0]):
      self.params, self.opt_state, self.critic_params, self.critic_opt_state, mm = self._update(
          self.params, self.opt_state, self.critic_params, self.critic_opt_state, self.frozen, rows, data, self._i32(m),
          self._i32(self.version), num_seqs=layout.slot.shape[0] + 1)
      metrics.append(mm)
    metrics = jax.device_get((start_metrics, metrics))
    out = {k: float(v) for k, v in metrics[0].items()}
    for k in metrics[1][0]:  # token-weighted metrics are batch fractions already; the rest average
      out[k] = float(sum(mm[k] for mm in metrics[1]))
    out.update(layout.stats())
    out["train_seconds"] = time.perf_counter() - start
    out["train_tokens_per_s"] = layout.real_tokens / out["train_seconds"]
    self.version += 1
    return out

  def gradients(self, batch: TrainBatch):
    """(loss, grads of the trained params) of the batch's first minibatch at the current params; no update."""
    layout, rows, data, _ = self._prepare(batch)
    loss, grads, _ = self._gradients(self.params, self.critic_params, self.frozen, rows, data, self._i32(0),
                                     self._i32(self.version), num_seqs=layout.slot.shape[0] + 1)
    return loss, grads[0]

  def score(self, batch: TrainBatch) -> np.ndarray:
    """[N, C] logprob (temperature 1) of each completion token under the current params; a few
    rows (the weight-sync probe), so they are replicated over the pool, not split."""
    put = lambda x: jax.device_put(x, self.pool.replicated())
    scored = TrainBatch(tokens=put(batch.tokens), valid=put(batch.valid), loss_mask=put(batch.loss_mask))
    return np.asarray(jax.device_get(self._score(self.whole(), scored)[0]))

  def _i32(self, value):
    """A scalar argument replicated on the pool, as footprint.train_step compiles it, so the
    preflight's compile of the update is this one (the persistent compilation cache's key)."""
    return jax.device_put(jnp.int32(value), self.pool.replicated())

  def weights(self):
    """(version, the trained params): with LoRA the adapters alone, which is all a sync moves."""
    return self.version, self.params

  def state(self) -> dict:
    """Everything a checkpoint must hold to resume this trainer (with LoRA not the base: the run
    names where it came from)."""
    state = {"params": self.params, "opt_state": saved_opt_state(self.opt_state)}
    if self.ref_params is not None:
      state["ref_params"] = self.ref_params
    if self.critic is not None:
      state["critic"] = {"params": self.critic_params, "opt_state": saved_opt_state(self.critic_opt_state)}
    return state

  def load_state(self, state: dict, version: int):
    self.params, self.version = state["params"], version
    self.opt_state = loaded_opt_state(state["opt_state"], self.opt_state)
    self.ref_params = state.get("ref_params", self.ref_params)
    if "critic" in state:
      self.critic_params = state["critic"]["params"]
      self.critic_opt_state = loaded_opt_state(state["critic"]["opt_state"], self.critic_opt_state)


def optimizer_shardings(pool, tx, param_shardings, param_shapes):
  """The optimizer state's shardings: each per-parameter leaf (Adam's moments) as its parameter,
  the rest (step counts) replicated on the pool. Left to XLA, tx.init's zeros come out replicated,
  every device holding whole moments."""
  state = jax.eval_shape(tx.init, param_shapes)
  return optax.tree_map_params(tx, lambda _, sharding: sharding, state, param_shardings,
                               transform_non_params=lambda _: pool.replicated())


def layout_of(objective, pool, batch: TrainBatch) -> packing.Layout:
  """The objective's layout of `batch` over the pool's batch shards (rl.packing, on the host)."""
  return packing.plan(batch.tokens, batch.valid, batch.loss_mask, shards=pool.batch_ways, group_ids=batch.group_ids,
                      **objective.layout_options)


def step_inputs(pool, layout: packing.Layout, batch: TrainBatch, place=jax.device_put):
  """A step's host layout and batch -> (Rows, per-sequence fields, slot, minibatch_of) on the
  pool, each array given to place(array, sharding): device_put, or a ShapeDtypeStruct maker for
  a program compiled without data (jaxrl_hex.footprint)."""
  put = lambda x, axes: place(x, pool.sharding(axes))
  fields = [f for f in dataclasses.fields(Rows) if "axes" in f.metadata and getattr(layout, f.name) is not None]
  rows = Rows(**{f.name: put(getattr(layout, f.name), f.metadata["axes"]) for f in fields}, head_from=layout.head_from)
  per_seq = jax.tree.map(lambda x: put(x, ("batch",) if x.ndim == 1 else ("batch", "length")),
                         dataclasses.replace(batch, tokens=None, valid=None))
  return rows, per_seq, put(layout.slot, ("batch", "length")), put(layout.minibatch_of, ("batch",))


def start_program(pool, objective, models):
  """The jitted start pass: StartInputs -> (TokenData, metrics); models = (policy, critic or None)."""
  return jax.jit(traced_under(pool.activation_sharding, functools.partial(objective.start, *models)))


def update_program(pool, objective, models, tx, critic_tx, state_shardings):
  """The jitted optimizer update of one minibatch: (params, opt_state, critic_params,
  critic_opt_state, frozen, rows, data, m, version; num_seqs) -> (the four updated, metrics). The state
  is donated (not the frozen base) and its output shardings pinned to `state_shardings` (the four states' shardings),
  since XLA may otherwise pick new layouts for it. Built from shardings alone, so a footprint
  can compile it without params (jaxrl_hex.footprint)."""
  return jax.jit(traced_under(pool.activation_sharding, functools.partial(_update, objective, models, tx, critic_tx)),
                 donate_argnums=(0, 1, 2, 3), static_argnames=("num_seqs",), out_shardings=(*state_shardings, None))


def _accumulate(objective, models, params, critic_params, frozen, rows, data, m, version, num_seqs):
  """Loss, (policy, critic) grads and metrics of minibatch m, summed over its micro-batches
  (the objective's per-token weights are normalised over the minibatch, so sums are exact).
  Gradients are of `params` only: the frozen base is a constant."""
  policy, critic = models

  def loss_of(params, critic_params, micro, index):
    dropout = policy.lora and policy.cfg.lora.dropout > 0  # a fresh mask per update and micro-batch
    model = policy.with_dropout(jax.random.fold_in(jax.random.key(version), m * 65536 + index)) if dropout else policy
    return objective.loss(model, critic, lora.merge(params, frozen), critic_params, *micro, m, version, num_seqs)

  grad_fn = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)
  micro_batches = jax.tree.map(lambda x: x[m], (rows, data))  # [K, R, L]

  def one(micro, index):
    (loss, metrics), grads = grad_fn(params, critic_params, micro, index)
    return loss, grads, metrics

  count = rows.tokens.shape[1]
  if count == 1:
    return one(jax.tree.map(lambda x: x[0], micro_batches), 0)
  # Every micro-batch runs in the loop, from zeros (0 + x is x, so the sums are those of adding
  # them in order): its temporaries are then the loop body's alone, one micro-batch's, where the
  # first micro-batch run before the loop needed a block of its own (W3 with 2: as many page
  # faults a step as without micro-batches; benchmarks/README.md, W3 against the matmul rate).
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       jax.eval_shape(one, jax.tree.map(lambda x: x[0], micro_batches), 0))
  add = lambda a, b: jax.tree.map(jnp.add, a, b)
  total, _ = jax.lax.scan(lambda acc, xs: (add(acc, one(*xs)), None), zeros, (micro_batches, jnp.arange(count)))
  return total


def _update(objective, models, tx, critic_tx, params, opt_state, critic_params, critic_opt_state, frozen, rows, data, m,
            version, num_seqs):
  loss, (grads, critic_grads), metrics = _accumulate(objective, models, params, critic_params, frozen, rows, data, m,
                                                     version, num_seqs)
  # a non-finite loss or gradient (a NaN reward got past its check, an overflow) skips the update:
  # params and optimizer state stay as they were, and the step counts it (nonfinite_updates)
  finite = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
  params, opt_state = _apply_if(finite, tx, grads, params, opt_state)
  if critic_tx is not None:
    critic_params, critic_opt_state = _apply_if(finite, critic_tx, critic_grads, critic_params, critic_opt_state)
  minibatches = rows.tokens.shape[0]
  metrics = dict(metrics, loss=loss / minibatches, grad_norm=optax.tree.norm(grads) / minibatches,
                 nonfinite_updates=1.0 - finite.astype(jnp.float32))
  return params, opt_state, critic_params, critic_opt_state, metrics


def _apply_if(finite, tx, grads, params, opt_state):
  """(params, opt_state) after tx's update where `finite`, else as they were. A branch, not a
  select of new against old: the select kept the old optimizer state alive beside the new, so
  XLA copied all of it before updating it in place."""

  def apply(state):
    updates, new_opt_state = tx.update(grads, state[1], state[0])
    return optax.apply_updates(state[0], updates), new_opt_state

  return jax.lax.cond(finite, apply, lambda state: state, (params, opt_state))
