"""The learner: params and optimizer state on the train pool, and the step that updates them.

A step lays the batch out into micro-batches (rl.packing, on the host), runs the objective's
start pass once on the whole batch (advantages, loss weights, reference / proximal / critic
forward passes), then takes one optimizer update per minibatch, accumulating gradients over its
micro-batches inside one jitted call. What is optimised is an objective (rl.objectives); the
trainer only owns state, shardings and the policy version. It never imports the engine.
"""
import functools
import time

import jax
import jax.numpy as jnp
import optax

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.decoder import causal_mask, extend_cache, init_cache
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.rl import packing

# [M, K, R, L] rows split over the batch axes; shared prompts [M, K, G, P] are replicated
LAYOUT_AXES = {
    "row_group": (None, None, "batch"),
    "prompt_tokens": (None, None, None, "length"),
    "prompt_positions": (None, None, None, "length"),
    "prompt_valid": (None, None, None, "length")
}
ROW_AXES = (None, None, "batch", "length")


def _logprobs(logits, targets, temperature):
  """logits [.., T, V], targets [.., T] -> (logp [.., T], entropy [.., T]) at `temperature`."""
  logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
  return logp, -(jnp.exp(logp_all) * logp_all).sum(-1)


def token_logprobs(policy, params, batch, temperature=1.0):
  """Rows as the engine lays them out -> (logp [N, C], entropy [N, C]) of each completion token."""
  tokens, valid = batch["tokens"], batch["valid"]
  p_len = tokens.shape[1] - batch["loss_mask"].shape[1]
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
  logits, _ = policy.apply(params, tokens[:, :-1], positions[:, :-1], causal_mask(valid[:, :-1]))
  return _logprobs(logits[:, p_len - 1:], tokens[:, p_len:], temperature)


def segment_mask(segments):
  """segments [R, L] (0 = padding) -> [R, L, L]: query t sees keys s <= t of its own sequence."""
  length = segments.shape[1]
  same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)
  return same & jnp.tril(jnp.ones((length, length), bool))[None]


def shared_prompt_logits(policy, params, micro):
  """Each of the micro-batch's G prompts [G, P] runs once; every completion row [R, C] attends to
  its group's prompt keys/values (gathered by row_group) and to its own earlier tokens.
  -> logits [R, C, V] aligned to the completion tokens (token 0 from the prompt's last position)."""
  tokens, valid, group = micro["tokens"], micro["segments"] > 0, micro["row_group"]
  p_valid = micro["prompt_valid"]
  g, p_len = p_valid.shape
  r, c_len = tokens.shape
  prompt_logits, cache = policy.apply(params, micro["prompt_tokens"], micro["prompt_positions"], causal_mask(p_valid),
                                      init_cache(policy.cfg, g, p_len), 0)
  cache = extend_cache(cache, group, c_len - 1)
  keys = jnp.concatenate([p_valid[group], valid[:, :-1]], axis=1)  # [R, P + C - 1]
  causal = jnp.arange(p_len + c_len - 1)[None, :] <= p_len + jnp.arange(c_len - 1)[:, None]
  logits, _ = policy.apply(params, tokens[:, :-1], micro["positions"][:, :-1], causal[None] & keys[:, None, :], cache,
                           p_len)
  return jnp.concatenate([prompt_logits[group, -1:], logits], axis=1)


def _layout_apply(policy, params, micro):
  """The model on one micro-batch of rows [R, L], next-token logits aligned to their targets:
  out[:, j] is the prediction of token j (from position j - 1); column 0 predicts nothing
  (with shared prompts, rows are completions and column 0 comes from the prompt)."""
  if "prompt_tokens" in micro:
    return shared_prompt_logits(policy, params, micro)
  tokens, segments = micro["tokens"], micro["segments"]
  logits, _ = policy.apply(params, tokens[:, :-1], micro["positions"][:, :-1], segment_mask(segments[:, :-1]))
  return jnp.pad(logits, ((0, 0), (1, 0), (0, 0)))


def layout_logprobs(policy, params, micro, temperature=1.0):
  """-> (logp [R, L], entropy [R, L]) of every token given its prefix in its own sequence."""
  return _logprobs(_layout_apply(policy, params, micro), micro["tokens"], temperature)


def layout_values(critic, critic_params, micro):
  """The critic's value of the state each token is predicted from [R, L]: its head's column 0
  (a linear value head on the final hidden state)."""
  return _layout_apply(critic, critic_params, micro)[..., 0]


def over_layout(fn, layout):
  """fn(micro) -> [R, L] arrays, applied to every micro-batch of [M, K, R, L] layout arrays."""
  m, k = layout["tokens"].shape[:2]
  flat = jax.tree.map(lambda x: x.reshape(m * k, *x.shape[2:]), layout)
  return jax.tree.map(lambda y: y.reshape(m, k, *y.shape[1:]), jax.lax.map(fn, flat))


def to_layout(x, slot, shape):
  """[N, C] per-token values -> layout arrays of `shape` (zero where no completion token lands)."""
  size = functools.reduce(lambda a, b: a * b, shape)
  return jnp.zeros(size, x.dtype).at[slot.reshape(-1)].set(x.reshape(-1), mode="drop").reshape(shape)


def from_layout(x, slot):
  """Layout arrays -> [N, C] values at each completion token's slot (zero off the completion)."""
  return jnp.take(x.reshape(-1), slot, mode="fill", fill_value=0)


def make_optimizer(optim, total_steps: int):
  schedule = optax.warmup_cosine_decay_schedule(0.0, optim.lr, min(optim.warmup_steps, max(total_steps - 1, 1)),
                                                max(total_steps, 2), end_value=optim.lr * optim.end_lr_ratio)
  return optax.chain(optax.clip_by_global_norm(optim.grad_clip),
                     optax.adamw(schedule, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay))


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

  def __init__(self, policy, pool, optimizer, loss_fn, params, ref_params=None):
    self.policy, self.pool, self.tx, self.objective = policy, pool, optimizer, loss_fn
    self.param_shardings = pool.shardings_for(policy.logical_axes(), policy.shapes())
    self.params = jax.device_put(params, self.param_shardings)
    self.ref_params = None if ref_params is None else jax.device_put(ref_params, self.param_shardings)
    self.opt_state = self._on_pool(jax.jit(self.tx.init)(self.params))
    self.critic = self.critic_params = self.critic_opt_state = self.critic_tx = None
    critic_shardings = critic_opt_shardings = None
    if loss_fn.critic_optimizer is not None:
      self.critic, self.critic_tx = critic_model(policy), loss_fn.critic_optimizer
      critic_shardings = pool.shardings_for(self.critic.logical_axes(), self.critic.shapes())
      self.critic_params = jax.jit(functools.partial(critic_init, self.critic),
                                   out_shardings=critic_shardings)(self.params)
      self.critic_opt_state = self._on_pool(jax.jit(self.critic_tx.init)(self.critic_params))
      critic_opt_shardings = jax.tree.map(lambda x: x.sharding, self.critic_opt_state)
    self.version = 0
    sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    # pinned output shardings: XLA may otherwise pick new layouts for the updated state
    state_shardings = (self.param_shardings, sharding_of(self.opt_state), critic_shardings, critic_opt_shardings)
    models = (policy, self.critic)
    self._start = jax.jit(functools.partial(loss_fn.start, *models))
    self._update = jax.jit(functools.partial(_update, loss_fn, models, self.tx,
                                             self.critic_tx), donate_argnums=(0, 1, 2, 3),
                           static_argnames=("num_seqs",), out_shardings=(*state_shardings, None))
    self._gradients = jax.jit(functools.partial(_accumulate, loss_fn, models), static_argnames=("num_seqs",))

  def _on_pool(self, tree):
    """Optimizer scalars (step counts) would land on a default device; keep them on this pool."""
    pool = self.pool
    return jax.tree.map(
        lambda x: x if getattr(x.sharding, "mesh", None) == pool.mesh else jax.device_put(x, pool.replicated()), tree)

  def plan(self, batch) -> packing.Layout:
    n = batch["tokens"].shape[0]
    if n % self.pool.batch_ways:
      raise UserError(f"train batch of {n} sequences does not divide over pool '{self.pool.name}' "
                      f"batch axes ({self.pool.batch_ways} ways); make the batch a multiple of it")
    return packing.plan(batch["tokens"], batch["valid"], batch["loss_mask"], shards=self.pool.batch_ways,
                        group_ids=batch.get("group_ids"), **self.objective.layout_options)

  def _prepare(self, batch):
    """Host batch -> (layout, device data of every minibatch, num_seqs)."""
    layout = self.plan(batch)
    put = lambda x, axes: jax.device_put(x, self.pool.sharding(axes))
    lay = {name: put(x, LAYOUT_AXES.get(name, ROW_AXES)) for name, x in layout.arrays.items()}
    per_seq = {
        k: put(v, ("batch",) if v.ndim == 1 else ("batch", "length")) for k, v in batch.items()
        if k not in ("tokens", "valid")
    }
    data, metrics = self._start(self.params, self.ref_params, self.critic_params, lay, per_seq,
                                put(layout.slot, ("batch", "length")), put(layout.minibatch_of, ("batch",)),
                                jnp.int32(self.version))
    return layout, dict(data, **lay), metrics

  def step(self, batch: dict) -> dict:
    start = time.perf_counter()
    layout, data, start_metrics = self._prepare(batch)
    metrics = []
    for m in range(layout.shape[0]):
      self.params, self.opt_state, self.critic_params, self.critic_opt_state, mm = self._update(
          self.params, self.opt_state, self.critic_params, self.critic_opt_state, data, jnp.int32(m),
          jnp.int32(self.version), num_seqs=layout.slot.shape[0] + 1)
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

  def gradients(self, batch: dict):
    """(loss, policy grads) of the batch's first minibatch at the current params; no update."""
    layout, data, _ = self._prepare(batch)
    loss, grads, _ = self._gradients(self.params, self.critic_params, data, jnp.int32(0), jnp.int32(self.version),
                                     num_seqs=layout.slot.shape[0] + 1)
    return loss, grads[0]

  def weights(self):
    return self.version, self.params

  def state(self) -> dict:
    """Everything a checkpoint must hold to resume this trainer."""
    state = {"params": self.params, "opt_state": self.opt_state}
    if self.ref_params is not None:
      state["ref_params"] = self.ref_params
    if self.critic is not None:
      state["critic"] = {"params": self.critic_params, "opt_state": self.critic_opt_state}
    return state

  def load_state(self, state: dict, version: int):
    self.params, self.opt_state, self.version = state["params"], state["opt_state"], version
    self.ref_params = state.get("ref_params", self.ref_params)
    if "critic" in state:
      self.critic_params, self.critic_opt_state = state["critic"]["params"], state["critic"]["opt_state"]


def _accumulate(objective, models, params, critic_params, data, m, version, num_seqs):
  """Loss, (policy, critic) grads and metrics of minibatch m, summed over its micro-batches
  (the objective's per-token weights are normalised over the minibatch, so sums are exact)."""
  grad_fn = jax.value_and_grad(objective.loss, argnums=(2, 3), has_aux=True)
  micro_batches = jax.tree.map(lambda x: x[m], data)  # [K, R, L]

  def one(micro):
    (loss, metrics), grads = grad_fn(*models, params, critic_params, micro, m, version, num_seqs)
    return loss, grads, metrics

  add = lambda a, b: jax.tree.map(jnp.add, a, b)
  first = one(jax.tree.map(lambda x: x[0], micro_batches))
  if micro_batches["tokens"].shape[0] == 1:
    return first
  rest = jax.tree.map(lambda x: x[1:], micro_batches)
  total, _ = jax.lax.scan(lambda acc, micro: (add(acc, one(micro)), None), first, rest)
  return total


def _update(objective, models, tx, critic_tx, params, opt_state, critic_params, critic_opt_state, data, m, version,
            num_seqs):
  loss, (grads, critic_grads), metrics = _accumulate(objective, models, params, critic_params, data, m, version,
                                                     num_seqs)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  if critic_tx is not None:
    critic_updates, critic_opt_state = critic_tx.update(critic_grads, critic_opt_state, critic_params)
    critic_params = optax.apply_updates(critic_params, critic_updates)
  minibatches = data["tokens"].shape[0]
  metrics = dict(metrics, loss=loss / minibatches, grad_norm=optax.tree.norm(grads) / minibatches)
  return params, opt_state, critic_params, critic_opt_state, metrics
