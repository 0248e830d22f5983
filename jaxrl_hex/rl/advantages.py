"""Advantage estimators: estimator(inputs, algo) -> (advantages [N, C], returns [N, C] or None).

Every estimator sees per-token rewards: a sequence's outcome reward (after overlong shaping)
sits on its last completion token, and with algo.kl_mode='reward' every token also carries
-kl_coef * KL. Group estimators score a sequence by the sum of its token rewards and broadcast
the advantage over its tokens. `returns` are the critic's regression targets (GAE only).

Register your own with @ADVANTAGES.register("name", needs_groups=..., needs_critic=...) (the
fields of `Estimator`; both default to False).
"""
import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_hex.rl.registry import Entry, Registry

EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Estimator(Entry):
  needs_groups: bool = False  # a group baseline: rollout.group_size >= 2, else every advantage is 0
  needs_critic: bool = False  # reads AdvantageInputs.values: the trainer learns a critic


ADVANTAGES = Registry("advantage estimator", "algo.advantage", Estimator)


@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
  token_rewards: jax.Array  # [N, C] fp32, zero off the completion
  mask: jax.Array  # [N, C] fp32, 1 on completion tokens
  group_ids: jax.Array  # [N], samples of one prompt share an id
  values: jax.Array | None = None  # [N, C] critic values at the start of the step

  @property
  def rewards(self):
    """Per-sequence reward [N]."""
    return (self.token_rewards * self.mask).sum(1)


def group_stats(x, group_ids):
  """Mean, population variance and size of each row's group. x, group_ids [N] -> 3 x [N].
  Groups need not be contiguous."""
  same = group_ids[:, None] == group_ids[None, :]  # [N, N]
  count = same.sum(1)
  mean = (same * x[None, :]).sum(1) / count
  var = (same * (x[None, :] - mean[:, None])**2).sum(1) / count
  return mean, var, count


def whiten(x, mask, eps=EPS):
  """(x - mean) / (std + eps) over the masked entries of the whole batch; 0 off the mask."""
  n = jnp.maximum(mask.sum(), 1)
  mean = (x * mask).sum() / n
  std = jnp.sqrt((((x - mean) * mask)**2).sum() / n)
  return (x - mean) / (std + eps) * mask


def discounted_cumsum(x, discount):
  """y_t = x_t + discount * y_{t+1} along the last axis (time). x [N, C]."""

  def back(carry, x_t):
    carry = x_t + discount * carry
    return carry, carry

  _, ys = jax.lax.scan(back, jnp.zeros_like(x[:, 0]), x.T, reverse=True)
  return ys.T


@ADVANTAGES.register("grpo", needs_groups=True)
def grpo(inp: AdvantageInputs, algo):
  """GRPO: (r - mean_group) / (std_group + eps)."""
  r = inp.rewards
  mean, var, _ = group_stats(r, inp.group_ids)
  return ((r - mean) / (jnp.sqrt(var) + EPS))[:, None] * inp.mask, None


@ADVANTAGES.register("drgrpo", needs_groups=True)
def drgrpo(inp: AdvantageInputs, algo):
  """Dr. GRPO: r - mean_group, no std division (pair with loss_agg='seq-mean-token-sum-norm',
  which drops the per-sequence length normalisation)."""
  r = inp.rewards
  mean, _, _ = group_stats(r, inp.group_ids)
  return (r - mean)[:, None] * inp.mask, None


@ADVANTAGES.register("rloo", needs_groups=True)
def rloo(inp: AdvantageInputs, algo):
  """REINFORCE leave-one-out: r_i - mean of the other samples of its group
  = (r_i - mean_group) * n / (n - 1)."""
  r = inp.rewards
  mean, _, n = group_stats(r, inp.group_ids)
  adv = jnp.where(n > 1, (r - mean) * n / jnp.maximum(n - 1, 1), 0.0)
  return adv[:, None] * inp.mask, None


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(inp: AdvantageInputs, algo):
  """REINFORCE++: discounted return-to-go of the token rewards, whitened over the batch."""
  returns = discounted_cumsum(inp.token_rewards * inp.mask, algo.gamma)
  return whiten(returns, inp.mask), None


@ADVANTAGES.register("gae", needs_critic=True)
def gae(inp: AdvantageInputs, algo):
  """Generalised advantage estimation with a learned critic: delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = delta_t + gamma lambda A_{t+1}; returns = A + V (the critic's targets); A whitened."""
  values = inp.values * inp.mask
  next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
  delta = (inp.token_rewards + algo.gamma * next_values - values) * inp.mask
  adv = discounted_cumsum(delta, algo.gamma * algo.gae_lambda)
  return whiten(adv, inp.mask), (adv + values) * inp.mask
