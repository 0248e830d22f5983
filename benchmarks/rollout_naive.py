"""The static-batch baseline: the repository's first engine (jitted prefill + while-loop decode).

A batch is left-padded to one prompt length and decodes until its last row is done, so every
row waits for the slowest one; kept here as the reference the continuous-batching engine is
measured against (benchmarks/rollout.py --engine naive).
"""
import functools

import jax
import jax.numpy as jnp

from jaxrl_hex.models.decoder import init_cache
from jaxrl_hex.rollout.sampling import sample


def make_static_generate(policy, max_new: int, eos_id: int, sampling: dict):
  """-> jitted fn(params, prompt, prompt_valid, budgets, rng)."""
  return jax.jit(functools.partial(_static_generate, policy, max_new, eos_id, sampling))


def _static_generate(policy, max_new, eos_id, sampling, params, prompt, prompt_valid, budgets, rng):
  """prompt/prompt_valid [N, P] left-padded, budgets [N] new tokens per row -> (tokens, mask, logprobs)."""
  n, p_len = prompt.shape
  total = p_len + max_new
  cache = init_cache(policy.cfg, n, total)
  key_valid = jnp.concatenate([prompt_valid, jnp.zeros((n, max_new), bool)], axis=1)  # [N, P+C]
  positions = jnp.maximum(jnp.cumsum(prompt_valid, axis=1) - 1, 0)
  prefill_mask = (jnp.arange(total)[None, :] <= jnp.arange(p_len)[:, None])[None] & key_valid[:, None, :]
  logits, cache = policy.apply(params, prompt, positions, prefill_mask, cache, 0)
  next_pos = positions[:, -1] + 1

  def body(state):
    t, logits, cache, key_valid, done, out_tok, out_lp, rng = state
    rng, step_rng = jax.random.split(rng)
    token, logprob = sample(logits, step_rng, **sampling)
    live = ~done
    token = jnp.where(live, token, 0)
    out_tok = out_tok.at[:, t].set(token)
    out_lp = out_lp.at[:, t].set(jnp.where(live, logprob, 0.0))
    key_valid = key_valid.at[:, p_len + t].set(live)
    done = done | (token == eos_id) | (t + 1 >= budgets)
    logits, cache = policy.apply(params, token[:, None], (next_pos + t)[:, None], key_valid[:, None, :], cache,
                                 p_len + t)
    return t + 1, logits[:, -1], cache, key_valid, done, out_tok, out_lp, rng

  def cond(state):
    return (state[0] < max_new) & ~jnp.all(state[4])

  init = (jnp.int32(0), logits[:, -1], cache, key_valid, jnp.zeros((n,), bool), jnp.zeros(
      (n, max_new), jnp.int32), jnp.zeros((n, max_new), jnp.float32), rng)
  _, _, _, key_valid, _, tokens, logprobs, _ = jax.lax.while_loop(cond, body, init)
  return tokens, key_valid[:, p_len:], logprobs
