"""What the trainer optimises. An objective has two jit-traced halves:

  start(policy, critic, params, ref_params, critic_params, layout, batch, slot, minibatch_of, version)
      once per step on the whole batch -> (per-token layout arrays for loss(), step metrics)
  loss(policy, critic, params, critic_params, micro, m, version, num_seqs)
      per micro-batch of minibatch m -> (sum of weighted per-token losses, metrics)

plus `layout_options` (how rl.packing lays the batch out) and `critic_optimizer` (None: no critic).
"""
import math

import jax
import jax.numpy as jnp
import optax

from jaxrl_hex.errors import UserError
from jaxrl_hex.rl.advantages import ADVANTAGES, AdvantageInputs
from jaxrl_hex.rl.aggregation import AGGREGATIONS, minibatch_weights
from jaxrl_hex.rl.losses import KL_ESTIMATORS, LOSSES, LossInputs, behaviour_weight, value_loss
from jaxrl_hex.rl.trainer import from_layout, layout_logprobs, layout_values, over_layout, to_layout

CHOICES = {
    "behav_weight_mode": ("mask", "truncate"),
    "behav_weight_level": ("token", "sequence"),
    "kl_mode": ("loss", "reward"),
    "kl_estimator": tuple(KL_ESTIMATORS),
    "prox_logp": ("recompute", "interpolate")
}


def _wsum(weights, x):
  return (weights * x).sum()


class SFTObjective:
  """Teacher forcing: token-mean negative log-likelihood of the answer tokens."""
  critic_optimizer = None
  layout_options = {}

  def start(self, policy, critic, params, ref_params, critic_params, layout, batch, slot, minibatch_of, version):
    mask = batch["loss_mask"].astype(jnp.float32)
    return {"weights": to_layout(mask / jnp.maximum(mask.sum(), 1), slot, layout["tokens"].shape)}, {}

  def loss(self, policy, critic, params, critic_params, micro, m, version, num_seqs):
    logp, _ = layout_logprobs(policy, params, micro)
    w = micro["weights"]
    return -_wsum(w, logp), {"token_accuracy": _wsum(w, logp > math.log(0.5))}


sft_loss = SFTObjective()


class RLObjective:
  """Advantages (algo.advantage) + a decoupled policy loss (algo.loss) aggregated by
  algo.loss_agg, with optional KL to a frozen reference, entropy bonus and critic."""

  def __init__(self, algo, temperature: float):
    self.algo, self.temperature = algo, temperature
    self.estimator = ADVANTAGES.get(algo.advantage)
    self.policy_loss = LOSSES.get(algo.loss)
    self.aggregate = AGGREGATIONS.get(algo.loss_agg)
    self.kl = KL_ESTIMATORS[algo.kl_estimator]
    self.critic_optimizer = None
    if getattr(self.estimator, "needs_critic", False):
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

  def start(self, policy, critic, params, ref_params, critic_params, layout, batch, slot, minibatch_of, version):
    a, shape = self.algo, layout["tokens"].shape
    mask = batch["loss_mask"].astype(jnp.float32)  # [N, C]
    behav = batch["behav_logp"] * mask
    lengths = mask.sum(1)
    logprobs_of = lambda p: over_layout(lambda micro: layout_logprobs(policy, p, micro, self.temperature)[0], layout)
    data, per_token, metrics = {}, {}, {"reward_mean": batch["rewards"].mean(), "response_length_mean": lengths.mean()}
    rewards = self.shaped_rewards(batch["rewards"], lengths, mask.shape[1])
    token_rewards = jax.nn.one_hot(lengths.astype(jnp.int32) - 1, mask.shape[1]) * rewards[:, None]
    if ref_params is not None:
      ref_logp = logprobs_of(ref_params)
      if a.kl_mode == "loss":
        data["ref_logp"] = ref_logp
      else:  # the sampling policy's KL to the reference, paid per token in the reward
        kl = self.kl(behav, from_layout(ref_logp, slot)) * mask
        token_rewards = token_rewards - a.kl_coef * kl
        metrics["kl"] = kl.sum() / jnp.maximum(mask.sum(), 1)
    if a.kl_mode != "loss" or ref_params is None:
      metrics.setdefault("kl", jnp.float32(0.0))
    if a.prox_logp == "recompute" and shape[0] > 1:  # one update per step: prox = sg(current), free
      data["prox_logp"] = logprobs_of(params)
    values = None
    if critic is not None:
      values = from_layout(over_layout(lambda micro: layout_values(critic, critic_params, micro), layout), slot)
    adv, returns = self.estimator(AdvantageInputs(token_rewards, mask, batch["group_ids"], values), a)
    per_token.update(loss_mask=mask, behav_logp=behav, advantages=adv,
                     weights=minibatch_weights(self.aggregate, mask, minibatch_of, shape[0],
                                               a), metric_weights=mask / jnp.maximum(mask.sum(), 1))
    if a.prox_logp == "interpolate":
      per_token["versions"] = batch["versions"]
    if critic is not None:
      per_token.update(old_values=values * mask, returns=returns)
    metrics["advantage_abs_mean"] = (jnp.abs(adv) * mask).sum() / jnp.maximum(mask.sum(), 1)
    data.update({k: to_layout(v, slot, shape) for k, v in per_token.items()})
    return data, metrics

  def proximal_logp(self, logp, micro, m, version):
    """Stored by start() (recompute, several updates per step), else the current logp at the
    step's first update, or AReaL's log-linear interpolation between behaviour and current by
    version: alpha = lag / (lag + m), lag = behaviour's age in optimizer updates."""
    if "prox_logp" in micro:
      return jnp.where(micro["loss_mask"] > 0, micro["prox_logp"], 0.0)
    current = jax.lax.stop_gradient(logp)
    if self.algo.prox_logp == "recompute":
      return current
    lag = (version - micro["versions"]).astype(jnp.float32) * self.algo.minibatches
    alpha = jnp.where(m == 0, 1.0, lag / jnp.maximum(lag + m, 1e-6))
    return micro["behav_logp"] + alpha * (current - micro["behav_logp"])

  def loss(self, policy, critic, params, critic_params, micro, m, version, num_seqs):
    a = self.algo
    mask, w, mw = micro["loss_mask"], micro["weights"], micro["metric_weights"]
    logp, entropy = layout_logprobs(policy, params, micro, self.temperature)
    logp = jnp.where(mask > 0, logp, 0.0)  # off-completion positions stay finite in every ratio
    inp = LossInputs(logp, self.proximal_logp(logp, micro, m, version), micro["behav_logp"], micro["advantages"], mask,
                     micro["seq"], num_seqs)
    inp.behav_weight, kept = behaviour_weight(inp, a.behav_weight_cap, a.behav_weight_mode, a.behav_weight_level)
    per_token, token_metrics = self.policy_loss(inp, a)
    total = _wsum(w, per_token)
    metrics = {k: _wsum(mw, v) for k, v in token_metrics.items()}
    metrics.update(entropy=_wsum(mw, entropy), behav_weight_mean=_wsum(mw, inp.behav_weight),
                   behav_kept_fraction=_wsum(mw, kept))
    if "ref_logp" in micro:
      kl = self.kl(logp, micro["ref_logp"])
      total = total + a.kl_coef * _wsum(w, kl)
      metrics["kl"] = _wsum(mw, kl)
    if a.entropy_coef:
      total = total - a.entropy_coef * _wsum(w, entropy)
    if critic is not None:
      values = layout_values(critic, critic_params, micro)
      vl = value_loss(values, micro["old_values"], micro["returns"], a.critic.value_clip)
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
  critic_free = [n for n in ADVANTAGES.names() if not getattr(ADVANTAGES.get(n), "needs_critic", False)]
  if getattr(estimator, "needs_groups", False) and r.group_size < 2:
    raise UserError(f"rollout.group_size={r.group_size} with algo.advantage={a.advantage!r}: a group baseline "
                    "from a single sample makes every advantage 0, so nothing is learned; set "
                    "rollout.group_size >= 2 or use a batch-level estimator (reinforce_pp, gae)")
  if a.dynamic_sampling and r.group_size < 2:
    raise UserError("algo.dynamic_sampling drops groups whose rewards all agree, which needs "
                    "rollout.group_size >= 2")
  if getattr(estimator, "needs_critic", False) and a.critic.lr <= 0:
    raise UserError(f"algo.advantage={a.advantage!r} (PPO) needs a learned critic for its values, but "
                    f"algo.critic.lr={a.critic.lr}; set --config.algo.critic.lr=1e-4 (see configs/ppo.py) "
                    f"or pick a critic-free estimator: {', '.join(critic_free)}")
  if a.behav_weight_cap <= 0:
    raise UserError(f"algo.behav_weight_cap={a.behav_weight_cap} must be > 0 (e.g. 5.0)")
  if a.share_prompts and (a.pack or r.prompts_per_step % a.minibatches):
    raise UserError("algo.share_prompts lays out whole groups, one prompt each: it excludes algo.pack, "
                    "and algo.minibatches must divide rollout.prompts_per_step")
  n = r.prompts_per_step * r.group_size
  if a.minibatches < 1 or n % a.minibatches:
    raise UserError(f"algo.minibatches={a.minibatches} must be >= 1 and divide the batch of "
                    f"{n} sequences (rollout.prompts_per_step x rollout.group_size)")
