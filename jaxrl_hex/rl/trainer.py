"""The learner: params and optimizer state on the train pool, one jitted update per batch.

What is optimised is a loss function (rl.objectives); the trainer only owns state, shardings
and the policy version. It never imports the engine.
"""
import functools
import time

import jax
import jax.numpy as jnp
import optax

from jaxrl_hex.errors import UserError
from jaxrl_hex.models import causal_mask


def token_logprobs(policy, params, batch, temperature=1.0):
  """-> (logp [N, C], entropy [N, C]) of each completion token under `params`."""
  tokens, valid = batch["tokens"], batch["valid"]
  c_len = batch["loss_mask"].shape[1]
  p_len = tokens.shape[1] - c_len
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
  logits, _ = policy.apply(params, tokens[:, :-1], positions[:, :-1], causal_mask(valid[:, :-1]))
  logits = logits[:, p_len - 1:] / temperature                    # [N, C, V]
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, tokens[:, p_len:, None], axis=-1)[..., 0]
  entropy = -(jnp.exp(logp_all) * logp_all).sum(-1)
  return logp, entropy


def make_optimizer(optim, total_steps: int):
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, optim.lr, min(optim.warmup_steps, max(total_steps - 1, 1)), max(total_steps, 2),
      end_value=optim.lr * optim.end_lr_ratio)
  return optax.chain(optax.clip_by_global_norm(optim.grad_clip),
                     optax.adamw(schedule, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay))


class Trainer:
  """step(batch) -> metrics; weights() -> (version, params). Version = optimizer steps taken."""

  def __init__(self, policy, pool, optimizer, loss_fn, params, ref_params=None):
    self.policy, self.pool, self.tx, self.loss_fn = policy, pool, optimizer, loss_fn
    self.param_shardings = pool.shardings_for(policy.logical_axes(), policy.shapes())
    self.params = jax.device_put(params, self.param_shardings)
    self.ref_params = None if ref_params is None else jax.device_put(ref_params, self.param_shardings)
    # optimizer scalars (step counts) would land on a default device; keep them on this pool
    on_pool = lambda x: x if getattr(x.sharding, "mesh", None) == pool.mesh else jax.device_put(x, pool.replicated())
    self.opt_state = jax.tree.map(on_pool, jax.jit(self.tx.init)(self.params))
    self.version = 0
    # pinned output shardings: XLA may otherwise pick new layouts for the updated params
    state_shardings = (self.param_shardings, jax.tree.map(lambda x: x.sharding, self.opt_state))
    self._step = jax.jit(functools.partial(_update, policy, self.tx, loss_fn), donate_argnums=(0, 1),
                         out_shardings=(*state_shardings, None))

  def step(self, batch: dict) -> dict:
    n = batch["tokens"].shape[0]
    if n % self.pool.batch_divisor:
      raise UserError(f"train batch of {n} sequences does not divide over pool '{self.pool.name}' "
                       f"batch axes ({self.pool.batch_divisor} ways); make the batch a multiple of it")
    sharding = self.pool.sharding(("batch", "length"))
    batch = {k: jax.device_put(v, sharding if v.ndim == 2 else self.pool.sharding(("batch",)))
             for k, v in batch.items()}
    start = time.perf_counter()
    self.params, self.opt_state, metrics = self._step(self.params, self.opt_state, self.ref_params, batch)
    metrics = jax.device_get(metrics)
    metrics["train_seconds"] = time.perf_counter() - start
    metrics["train_tokens_per_s"] = float(batch_tokens(batch)) / metrics["train_seconds"]
    self.version += 1
    return {k: float(v) for k, v in metrics.items()}

  def weights(self):
    return self.version, self.params

  def state(self) -> dict:
    return {"params": self.params, "opt_state": self.opt_state}

  def load_state(self, state: dict, version: int):
    self.params, self.opt_state, self.version = state["params"], state["opt_state"], version


def batch_tokens(batch) -> int:
  return int(jax.device_get(batch["valid"].sum()))


def _update(policy, tx, loss_fn, params, opt_state, ref_params, batch):
  (loss, metrics), grads = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)(
      policy, params, ref_params, batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
  return params, opt_state, metrics
