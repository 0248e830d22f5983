"""Policy losses in AReaL's decoupled form, the behaviour weight, KL estimators, the value loss.

Each token has three logprobs: behaviour (the engine's, when it was sampled), proximal (the
trainer's weights at the start of the step) and current (the weights being optimised).
u = pi / pi_prox is what the losses clip; w = pi_prox / pi_behav corrects for stale samples and
is capped per token or per sequence (above the cap: masked to 0 or truncated to the cap).

  ppo        -w * min(u A, clip(u, 1 - eps_low, 1 + eps_high) A)   (asymmetric: DAPO clip-higher)
  dual_clip  as ppo, but for A < 0 the objective is floored at c * A (Ye et al.)
  gspo       as ppo with u replaced by the sequence ratio s = exp(mean_t log u_t) (GSPO-token form)
  cispo      -w * sg(clip(u, 1 - eps_low, 1 + eps_high)) * A * log pi   (MiniMax-M1)

A loss maps LossInputs to (per-token loss, {metric: per-token value}); rl.aggregation weights
and sums the per-token loss, so every loss works with every aggregation. Register your own with
@LOSSES.register("name").
"""
import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxrl_hex.rl.registry import Registry

LOSSES = Registry("policy loss", "algo.loss")


@dataclasses.dataclass
class LossInputs:
  """Per-token arrays of one shape S ([N, C] padded rows, or [R, L] packed rows)."""
  logp: jax.Array  # current policy, differentiable
  prox_logp: jax.Array  # proximal policy, constant
  behav_logp: jax.Array  # behaviour policy, constant
  advantages: jax.Array
  mask: jax.Array  # fp32, 1 on completion tokens
  seq: jax.Array  # int32 sequence id of each token, in [0, num_seqs)
  num_seqs: int
  behav_weight: jax.Array | None = None  # pi_prox / pi_behav after the cap, set by behaviour_weight

  @classmethod
  def padded(cls, logp, prox_logp, behav_logp, advantages, mask):
    """Rows are sequences: [N, C] arrays, advantages [N] or [N, C]."""
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    n = logp.shape[0]
    seq = jnp.broadcast_to(jnp.arange(n)[:, None], logp.shape)
    return cls(logp, prox_logp, behav_logp, jnp.broadcast_to(adv, logp.shape), mask.astype(jnp.float32), seq, n)

  def seq_sum(self, x):
    """Per-token x -> the sum of x over each token's sequence, broadcast back to its tokens."""
    sums = jax.ops.segment_sum(x.reshape(-1), self.seq.reshape(-1), num_segments=self.num_seqs)
    return sums[self.seq]

  def seq_mean(self, x):
    return self.seq_sum(x * self.mask) / jnp.maximum(self.seq_sum(self.mask), 1.0)


def behaviour_weight(inp: LossInputs, cap: float, mode: str = "mask", level: str = "token"):
  """w = pi_prox / pi_behav per token ('token') or per sequence ('sequence': the product over
  its tokens, broadcast), capped: 'mask' zeroes weights above the cap, 'truncate' clips them.
  Returns (w, kept) with w constant and 0 off the completion."""
  log_w = jnp.where(inp.mask > 0, inp.prox_logp - inp.behav_logp, 0.0)
  if level == "sequence":
    log_w = inp.seq_sum(log_w)
  log_cap = math.log(cap)
  w = jnp.exp(jnp.minimum(log_w, log_cap))  # never overflows; exact below the cap
  kept = (log_w <= log_cap) if mode == "mask" else jnp.ones_like(w, bool)
  w = jnp.where(kept, w, 0.0) * inp.mask
  return jax.lax.stop_gradient(w), kept.astype(jnp.float32)


def _clip_objective(ratio, inp, algo):
  unclipped = ratio * inp.advantages
  clipped = jnp.clip(ratio, 1 - algo.clip_eps_low, 1 + algo.clip_eps_high) * inp.advantages
  return jnp.minimum(unclipped, clipped), (clipped < unclipped).astype(jnp.float32)


@LOSSES.register("ppo")
def ppo(inp: LossInputs, algo):
  objective, clipped = _clip_objective(jnp.exp(inp.logp - inp.prox_logp), inp, algo)
  return -inp.behav_weight * objective, {"clip_fraction": clipped}


@LOSSES.register("dual_clip")
def dual_clip(inp: LossInputs, algo):
  objective, clipped = _clip_objective(jnp.exp(inp.logp - inp.prox_logp), inp, algo)
  floor = algo.dual_clip_c * inp.advantages
  floored = (inp.advantages < 0) & (objective < floor)
  objective = jnp.where(floored, floor, objective)
  return -inp.behav_weight * objective, {"clip_fraction": clipped, "dual_clip_fraction": floored.astype(jnp.float32)}


@LOSSES.register("gspo")
def gspo(inp: LossInputs, algo):
  """s_t = sg(s) * pi_t / sg(pi_t): its value is the sequence ratio s, its gradient s * grad log pi_t,
  so with seq-mean-token-mean aggregation the gradient is GSPO's sequence-level one."""
  log_s = inp.seq_mean(inp.logp - inp.prox_logp)
  ratio = jnp.exp(jax.lax.stop_gradient(log_s) + inp.logp - jax.lax.stop_gradient(inp.logp))
  objective, clipped = _clip_objective(ratio, inp, algo)
  return -inp.behav_weight * objective, {"clip_fraction": clipped}


@LOSSES.register("cispo")
def cispo(inp: LossInputs, algo):
  """REINFORCE with a clipped, stop-gradient importance weight: every token keeps a gradient."""
  ratio = jnp.exp(inp.logp - inp.prox_logp)
  is_weight = jnp.clip(ratio, 1 - algo.clip_eps_low, 1 + algo.clip_eps_high)
  clipped = (is_weight != ratio).astype(jnp.float32)
  return (-inp.behav_weight * jax.lax.stop_gradient(is_weight) * inp.advantages * inp.logp, {"clip_fraction": clipped})


def kl_k1(logp, ref_logp):
  """log pi - log ref: unbiased, can be negative."""
  return logp - ref_logp


def kl_k2(logp, ref_logp):
  """(log pi - log ref)^2 / 2: biased, low variance, its gradient is that of KL's."""
  return 0.5 * (logp - ref_logp)**2


def kl_k3(logp, ref_logp):
  """Schulman's k3: exp(r) - 1 - r, r = log ref - log pi; unbiased and >= 0."""
  r = jnp.clip(ref_logp - logp, -20.0, 20.0)
  return jnp.exp(r) - 1 - r


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def value_loss(values, old_values, returns, clip: float):
  """PPO's clipped value loss per token: 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2)."""
  clipped = old_values + jnp.clip(values - old_values, -clip, clip)
  return 0.5 * jnp.maximum((values - returns)**2, (clipped - returns)**2)
