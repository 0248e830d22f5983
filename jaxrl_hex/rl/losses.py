"""Decoupled PPO-clip (AReaL) with asymmetric clip, and the k3 KL estimator.

J = E[ w_behav * min(u * A, clip(u, 1 - eps_low, 1 + eps_high) * A) ],
u = pi_theta / pi_prox, w_behav = pi_prox / pi_behav (capped: tokens above the cap are masked
or truncated). All inputs are per token [N, C]; `mask` selects completion tokens.
"""
import jax
import jax.numpy as jnp


def masked_mean(x, mask):
  return (x * mask).sum() / jnp.maximum(mask.sum(), 1)


def decoupled_ppo(logp, prox_logp, behav_logp, advantages, mask, eps_low, eps_high,
                  behav_cap, behav_mode="mask"):
  """Returns (loss, metrics). advantages [N] or [N, C]."""
  adv = advantages[:, None] if advantages.ndim == 1 else advantages
  mask = mask.astype(jnp.float32)
  ratio = jnp.exp(logp - prox_logp)
  behav_w = jnp.exp(prox_logp - behav_logp)
  if behav_mode == "mask":
    mask = mask * (behav_w <= behav_cap)
  else:
    behav_w = jnp.minimum(behav_w, behav_cap)
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * adv
  objective = jax.lax.stop_gradient(behav_w) * jnp.minimum(unclipped, clipped)
  loss = -masked_mean(objective, mask)
  metrics = {"clip_fraction": masked_mean((clipped < unclipped).astype(jnp.float32), mask),
             "behav_weight_mean": masked_mean(behav_w, mask)}
  return loss, metrics


def kl_k3(logp, ref_logp):
  """Schulman's k3 estimator of KL(pi || ref) per token: exp(r) - 1 - r, r = ref - logp."""
  r = ref_logp - logp
  return jnp.exp(r) - 1 - r
