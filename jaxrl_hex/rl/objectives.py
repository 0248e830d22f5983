"""Loss functions the trainer optimises: loss_fn(policy, params, ref_params, batch) -> (loss, metrics)."""
import functools

import jax
import jax.numpy as jnp

from jaxrl_hex.rl import advantages, losses
from jaxrl_hex.rl.trainer import token_logprobs


def sft_loss(policy, params, ref_params, batch):
  logp, _ = token_logprobs(policy, params, batch)
  mask = batch["loss_mask"]
  nll = losses.masked_mean(-logp, mask)
  acc = losses.masked_mean((logp > jnp.log(0.5)).astype(jnp.float32), mask)
  return nll, {"token_accuracy": acc}


def grpo_loss(algo, temperature, policy, params, ref_params, batch):
  """GRPO advantages + decoupled PPO-clip. One update per batch, so the proximal policy is
  the current one at the start of the step (its logprobs are those of this forward pass)."""
  mask = batch["loss_mask"]
  logp, entropy = token_logprobs(policy, params, batch, temperature)
  prox_logp = jax.lax.stop_gradient(logp)
  adv = advantages.grpo(batch["rewards"], batch["group_ids"])
  loss, metrics = losses.decoupled_ppo(logp, prox_logp, batch["behav_logp"], adv, mask,
                                       algo.clip_eps_low, algo.clip_eps_high,
                                       algo.behav_weight_cap, algo.behav_weight_mode)
  kl = jnp.float32(0.0)
  if ref_params is not None:
    ref_logp, _ = token_logprobs(policy, ref_params, batch, temperature)
    kl = losses.masked_mean(losses.kl_k3(logp, jax.lax.stop_gradient(ref_logp)), mask)
    loss = loss + algo.kl_coef * kl
  return loss, dict(metrics, kl=kl, entropy=losses.masked_mean(entropy, mask),
                    reward_mean=batch["rewards"].mean())


def make_rl_loss(algo, temperature):
  return functools.partial(grpo_loss, algo, temperature)
