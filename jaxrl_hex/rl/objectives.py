"""What the trainer optimises. An objective has two jit-traced halves:

  start(policy, critic, inputs: StartInputs)
      once per step on the whole batch -> (TokenData in the layout, for loss(); step metrics)
  loss(policy, critic, params, critic_params, rows, data, m, version, num_seqs)
      per micro-batch (Rows, TokenData) of minibatch m -> (sum of weighted per-token losses, metrics)

plus `layout_options` (how rl.packing lays the batch out) and `critic_optimizer` (None: no critic).
"""
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl_hex.errors import UserError
from jaxrl_hex.rl.advantages import ADVANTAGES, AdvantageInputs
from jaxrl_hex.rl.aggregation import AGGREGATIONS, minibatch_weights
from jaxrl_hex.rl.batch import TrainBatch
from jaxrl_hex.rl.layout import Rows, TokenData, from_layout, layout_logprobs, layout_values, over_layout, to_layout
from jaxrl_hex.rl.losses import KL_ESTIMATORS, LOSSES, LossInputs, behaviour_weight, value_loss

CHOICES = {
    "behav_weight_mode": ("mask", "truncate"),
    "behav_weight_level": ("token", "sequence"),
    "kl_mode": ("loss", "reward"),
    "kl_estimator": tuple(KL_ESTIMATORS),
    "prox_logp": ("recompute", "interpolate")
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StartInputs:
  """What start() reads, on the train pool."""
  params: Any  # the policy's, at the start of the step
  rows: Rows  # [M, K, R, L] the whole layout
  batch: TrainBatch  # per-sequence fields [N] / [N, C]; tokens and valid None (the model reads rows)
  slot: jax.Array  # [N, C] int32, each completion token's flat index in the layout
  minibatch_of: jax.Array  # [N] int32
  ref_params: Any = None  # a frozen reference policy, for the KL
  critic_params: Any = None  # when the objective learns a critic


def _wsum(weights, x):
  return (weights * x).sum()


class SFTObjective:
  """Teacher forcing: token-mean negative log-likelihood of the answer tokens."""
  critic_optimizer = None
  layout_options = {}

  def start(self, policy, critic, inp: StartInputs):
    mask = inp.batch.loss_mask.astype(jnp.float32)
    return TokenData(weights=to_layout(mask / jnp.maximum(mask.sum(), 1), inp.slot, inp.rows.tokens.shape)), {}

  def loss(self, policy, critic, params, critic_params, rows: Rows, data: TokenData, m, version, num_seqs):
    logp, _ = layout_logprobs(policy, params, rows)
    w = data.weights
    return -_wsum(w, logp), {"token_accuracy": _wsum(w, logp > math.log(0.5))}


sft_loss = SFTObjective()


class RLObjective:
  """Advantages (algo.advantage) + a decoupled policy loss (algo.loss) aggregated by
  algo.loss_agg, with optional KL to a frozen reference, entropy bonus and critic."""

  def __init__(self, algo, temperature: float):
    self.algo, self.temperature = algo, temperature
    estimator = ADVANTAGES.get(algo.advantage)
    self.estimator = estimator.fn
    self.policy_loss = LOSSES.get(algo.loss).fn
    self.aggregate = AGGREGATIONS.get(algo.loss_agg).fn
    self.kl = KL_ESTIMATORS[algo.kl_estimator]
    self.critic_optimizer = None
    if estimator.needs_critic:
      self.critic_optimizer = optax.chain(optax.clip_by_global_norm(algo.critic.grad_clip),
                                          optax.adamw(algo.critic.lr, weight_decay=0.0))
    self.layout_options = dict(minibatches=algo.minibatches, micro_batch_tokens=algo.micro_batch_tokens, pack=algo.pack,
                               row_length=algo.pack_length, share_prompts=algo.share_prompts)

  def shaped_rewards(self, rewards, lengths, width: int):
    """DAPO's soft overlong punishment: 0 up to width - buffer tokens, then linearly down to
    -overlong_penalty at `width` (max_new_tokens)."""
    a = self.algo
    if a.overlong_buffer <= 0:
      return rewards
    over = lengths - (width - a.overlong_buffer)
    return rewards - jnp.clip(over / a.overlong_buffer, 0.0, 1.0) * a.overlong_penalty

  def start(self, policy, critic, inp: StartInputs):
    a, b, slot, shape = self.algo, inp.batch, inp.slot, inp.rows.tokens.shape
    mask = b.loss_mask.astype(jnp.float32)  # [N, C]
    behav = b.behav_logp * mask
    lengths = mask.sum(1)
    logprobs_of = lambda p: over_layout(lambda rows: layout_logprobs(policy, p, rows, self.temperature)[0], inp.rows)
    lay = lambda x: to_layout(x, slot, shape)
    metrics = {"reward_mean": b.rewards.mean(), "response_length_mean": lengths.mean()}
    rewards = self.shaped_rewards(b.rewards, lengths, mask.shape[1])
    # the reward sits on the sequence's last trained token: an episode's turns are not a prefix of its
    # completion (observations lie between them), so it is the last masked column, not column length - 1
    last = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1)
    token_rewards = jax.nn.one_hot(last, mask.shape[1]) * rewards[:, None]
    ref_logp = None
    if inp.ref_params is not None and a.kl_mode == "loss":
      ref_logp = logprobs_of(inp.ref_params)
    elif inp.ref_params is not None:  # the sampling policy's KL to the reference, paid per token in the reward
      kl = self.kl(behav, from_layout(logprobs_of(inp.ref_params), slot)) * mask
      token_rewards = token_rewards - a.kl_coef * kl
      metrics["kl"] = kl.sum() / jnp.maximum(mask.sum(), 1)
    if ref_logp is None:  # otherwise loss() reports it
      metrics.setdefault("kl", jnp.float32(0.0))
    # with one update per step loss() takes prox = sg(current), for free
    prox_logp = logprobs_of(inp.params) if a.prox_logp == "recompute" and shape[0] > 1 else None
    values = None
    if critic is not None:
      values = from_layout(over_layout(lambda rows: layout_values(critic, inp.critic_params, rows), inp.rows), slot)
    adv, returns = self.estimator(AdvantageInputs(token_rewards, mask, b.group_ids, values), a)
    metrics["advantage_abs_mean"] = (jnp.abs(adv) * mask).sum() / jnp.maximum(mask.sum(), 1)
    weights = minibatch_weights(self.aggregate, mask, inp.minibatch_of, shape[0], a)
    data = TokenData(weights=lay(weights), loss_mask=lay(mask), behav_logp=lay(behav), advantages=lay(adv),
                     metric_weights=lay(mask / jnp.maximum(mask.sum(), 1)), prox_logp=prox_logp, ref_logp=ref_logp,
                     versions=lay(b.versions) if a.prox_logp == "interpolate" else None,
                     old_values=None if critic is None else lay(values * mask),
                     returns=None if critic is None else lay(returns))
    return data, metrics

  def proximal_logp(self, logp, data: TokenData, m, version):
    """Stored by start() (recompute, several updates per step), else the current logp at the
    step's first update, or AReaL's log-linear interpolation between behaviour and current by
    version: alpha = lag / (lag + m), lag = behaviour's age in optimizer updates."""
    if data.prox_logp is not None:
      return jnp.where(data.loss_mask > 0, data.prox_logp, 0.0)
    current = jax.lax.stop_gradient(logp)
    if self.algo.prox_logp == "recompute":
      return current
    lag = (version - data.versions).astype(jnp.float32) * self.algo.minibatches
    alpha = jnp.where(m == 0, 1.0, lag / jnp.maximum(lag + m, 1e-6))
    return data.behav_logp + alpha * (current - data.behav_logp)

  def loss(self, policy, critic, params, critic_params, rows: Rows, data: TokenData, m, version, num_seqs):
    a = self.algo
    mask, w, mw = data.loss_mask, data.weights, data.metric_weights
    logp, entropy = layout_logprobs(policy, params, rows, self.temperature)
    logp = jnp.where(mask > 0, logp, 0.0)  # off-completion positions stay finite in every ratio
    inp = LossInputs(logp, self.proximal_logp(logp, data, m, version), data.behav_logp, data.advantages, mask, rows.seq,
                     num_seqs)
    inp.behav_weight, kept = behaviour_weight(inp, a.behav_weight_cap, a.behav_weight_mode, a.behav_weight_level)
    per_token, token_metrics = self.policy_loss(inp, a)
    total = _wsum(w, per_token)
    metrics = {k: _wsum(mw, v) for k, v in token_metrics.items()}
    metrics.update(entropy=_wsum(mw, entropy), behav_weight_mean=_wsum(mw, inp.behav_weight),
                   behav_kept_fraction=_wsum(mw, kept))
    if data.ref_logp is not None:
      kl = self.kl(logp, data.ref_logp)
      total = total + a.kl_coef * _wsum(w, kl)
      metrics["kl"] = _wsum(mw, kl)
    if a.entropy_coef:
      total = total - a.entropy_coef * _wsum(w, entropy)
    if critic is not None:
      values = layout_values(critic, critic_params, rows)
      vl = value_loss(values, data.old_values, data.returns, a.critic.value_clip)
      total = total + a.critic.vf_coef * _wsum(w, vl)
      metrics["value_loss"] = _wsum(mw, vl)
    return total, metrics


def make_rl_loss(algo, temperature):
  return RLObjective(algo, temperature)


def validate_algo(cfg):
  """Config checks for cfg.algo (no JAX): names resolve, choices exist, the estimator's needs
  (groups, a critic) are met. Raises UserError with the fix."""
  a, r = cfg.algo, cfg.rollout
  estimator = ADVANTAGES.get(a.advantage)
  LOSSES.get(a.loss)
  AGGREGATIONS.get(a.loss_agg)
  for field, choices in CHOICES.items():
    if a[field] not in choices:
      raise UserError(f"algo.{field}={a[field]!r}; use one of {', '.join(choices)}")
  critic_free = [n for n in ADVANTAGES.names() if not ADVANTAGES.get(n).needs_critic]
  if estimator.needs_groups and r.group_size < 2:
    raise UserError(f"rollout.group_size={r.group_size} with algo.advantage={a.advantage!r}: a group baseline "
                    "from a single sample makes every advantage 0, so nothing is learned; set "
                    "rollout.group_size >= 2 or use a batch-level estimator (reinforce_pp, gae)")
  if a.dynamic_sampling and r.group_size < 2:
    raise UserError("algo.dynamic_sampling drops groups whose rewards all agree, which needs "
                    "rollout.group_size >= 2")
  if estimator.needs_critic and a.critic.lr <= 0:
    raise UserError(f"algo.advantage={a.advantage!r} (PPO) needs a learned critic for its values, but "
                    f"algo.critic.lr={a.critic.lr}; set --config.algo.critic.lr=1e-4 (see configs/ppo.py) "
                    f"or pick a critic-free estimator: {', '.join(critic_free)}")
  if a.behav_weight_cap <= 0:
    raise UserError(f"algo.behav_weight_cap={a.behav_weight_cap} must be > 0 (e.g. 5.0)")
  if a.share_prompts and r.prompts_per_step % a.minibatches:
    raise UserError("algo.share_prompts lays out whole groups, one prompt each: algo.minibatches must divide "
                    "rollout.prompts_per_step")
  n = r.prompts_per_step * r.group_size
  if a.minibatches < 1 or n % a.minibatches:
    raise UserError(f"algo.minibatches={a.minibatches} must be >= 1 and divide the batch of "
                    f"{n} sequences (rollout.prompts_per_step x rollout.group_size)")
