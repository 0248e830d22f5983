"""Token sampling inside jit: temperature, top-k, top-p, and the behaviour logprob of the pick.

The logprob is taken from the temperature-scaled distribution before top-k/top-p truncation,
which is the distribution the trainer recomputes (rl.trainer.token_logprobs).
"""
import jax
import jax.numpy as jnp


def sample(logits, rng, temperature: float, top_k: int = 0, top_p: float = 1.0):
  """logits [B, V] fp32 -> (tokens [B] int32, logprobs [B]). temperature 0 is greedy."""
  if temperature == 0.0:
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
  else:
    scaled = logits / temperature
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    filtered = scaled
    if top_k and top_k < logits.shape[-1]:
      kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
      filtered = jnp.where(scaled < kth, -jnp.inf, filtered)
    if top_p < 1.0:
      sorted_logits = jnp.sort(filtered, axis=-1)[..., ::-1]
      cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
      # keep the smallest prefix whose mass reaches top_p: the cutoff is the first logit past it
      cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
      cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
      filtered = jnp.where(filtered < cutoff, -jnp.inf, filtered)
    token = jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)
  return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
