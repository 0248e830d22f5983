"""Token sampling inside jit: temperature, top-k, top-p, min-p, and the behaviour logprob of the pick.

The logprob is taken from the temperature-scaled distribution before any truncation, which is
the distribution the trainer recomputes (rl.layout.token_logprobs).

No sort of the vocabulary: top-k and top-p find their logit cutoffs by bisection (a fixed number
of O(V) passes, which beats an O(V log V) sort on large vocabularies and keeps the shapes static;
top-k's over the tokens of its blocks with the largest maxima only), min-p is one comparison
against the max. The draw itself is by inverse CDF: one uniform per row, a running sum over
blocks of tokens and then over one block's tokens.
"""
import math

import jax
import jax.numpy as jnp

BISECTION_STEPS = 32  # halves the logit interval 32 times: far below fp32 spacing of real logits


def _cutoff(values, weights, need):
  """values, weights [B, N] -> [B, 1]: the largest value c such that the weights of the values
  >= c sum to >= need, by bisection over the values' range (a fixed number of O(N) passes),
  snapped up to a value, so that {values >= c} is exactly the set kept."""
  lo = jnp.min(jnp.where(values > -jnp.inf, values, jnp.inf), axis=-1, keepdims=True)  # feasible: all of them
  hi = jnp.max(values, axis=-1, keepdims=True)

  def step(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) / 2
    ok = jnp.sum(jnp.where(values >= mid, weights, 0.0), axis=-1, keepdims=True) >= need
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, BISECTION_STEPS, step, (lo, hi))
  return jnp.min(jnp.where(values >= lo, values, jnp.inf), axis=-1, keepdims=True)


def top_p_cutoff(scaled, top_p: float):
  """scaled [B, V] -> [B, 1]: the largest logit c such that the tokens with logit >= c hold >= top_p mass.

  Keeping logits >= c is the smallest prefix of the sorted distribution that reaches top_p
  (ties at the cutoff are all kept)."""
  return _cutoff(scaled, jax.nn.softmax(scaled, axis=-1), top_p)


def top_k_cutoff(scaled, top_k: int):
  """scaled [B, V] -> [B, 1]: the top_k-th largest logit, ties counted (lax.top_k(scaled,
  top_k)[0][:, -1:]), without lax.top_k: XLA:CPU sorts whole rows, 860 ms at 32 x 151,936 on this
  CPU. The top_k blocks (_blocks) with the largest maxima hold it: a token above it lies in a
  block whose maximum is at least as large, and those blocks' maxima are top_k tokens at or
  above it. So the blocks are picked, one maximum at a time, and the cutoff found among their
  tokens [B, top_k x W]; where that is not much less than the row, among the row's."""
  blocks = _blocks(scaled, -jnp.inf)  # [B, C, W]
  rows, count, width = blocks.shape
  if 4 * top_k > count:
    return _cutoff(scaled, jnp.ones_like(scaled), top_k)

  maxima = jnp.max(blocks, axis=-1)  # [B, C]

  def pick(i, carry):  # the largest block not yet picked, the first among equals
    taken, picked = carry
    tops = jnp.where(taken, -jnp.inf, maxima)
    block = _first((tops == jnp.max(tops, axis=-1, keepdims=True)) & ~taken)
    return taken | (jnp.arange(count) == block[:, None]), picked.at[:, i].set(block)

  _, picked = jax.lax.fori_loop(0, top_k, pick, (jnp.zeros((rows, count), bool), jnp.zeros((rows, top_k), jnp.int32)))
  candidates = jnp.take_along_axis(blocks, picked[:, :, None], axis=1).reshape(rows, -1)
  return _cutoff(candidates, jnp.ones_like(candidates), top_k)


def sample(logits, rng, temperature, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
  """logits [B, V] fp32 -> (tokens [B] int32, logprobs [B]). temperature 0 is greedy.
  temperature: a Python float (a constant of the program) or a traced scalar, so one program
  serves greedy and sampled decoding (the greedy pick replaces the draw where it is 0).
  rng: one key for the batch, or [B] keys, one per row (a row's draw then depends on its own key
  only, not on which rows share the batch), or the [B] uniforms those keys give (uniforms), drawn
  beforehand."""
  static = isinstance(temperature, (int, float))
  if static and temperature == 0.0:
    token, scaled = greedy_tokens(logits), logits
  else:
    greedy = None if static else temperature == 0.0
    scaled = logits / (temperature if static else jnp.where(greedy, 1.0, temperature))
    filtered = scaled
    if top_k and top_k < logits.shape[-1]:
      filtered = jnp.where(scaled < top_k_cutoff(scaled, top_k), -jnp.inf, filtered)
    if top_p < 1.0:
      filtered = jnp.where(filtered < top_p_cutoff(filtered, top_p), -jnp.inf, filtered)
    if min_p > 0.0:
      # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
      floor = jnp.max(filtered, axis=-1, keepdims=True) + jnp.log(min_p)
      filtered = jnp.where(filtered < floor, -jnp.inf, filtered)
    token = inverse_cdf_sample(filtered, rng)
    if greedy is not None:
      token = jnp.where(greedy, greedy_tokens(logits), token)
  return token, picked_logprobs(scaled, token)


def picked_logprobs(scaled, token):
  """log_softmax(scaled) [B, V] at token [B], as jax.nn.log_softmax computes it (shifted by the
  max, less the log of the shifted exps' sum), without its [B, V] result."""
  top = jnp.max(scaled, axis=-1, keepdims=True)
  norm = jnp.log(jnp.sum(jnp.exp(scaled - top), axis=-1))
  return (jnp.take_along_axis(scaled, token[:, None], axis=-1) - top)[:, 0] - norm


def uniforms(rng, rows: int):
  """One key or [B] keys -> the [B] uniforms in [0, 1) a draw with them uses (key i's for row i)."""
  return jax.vmap(jax.random.uniform)(rng) if rng.shape else jax.random.uniform(rng, (rows,))


def block_width(vocab: int) -> int:
  """Tokens per block of inverse_cdf_sample's two-level running sum: about sqrt(vocab), a power of
  two in [32, 512] (best on this CPU at 512, 32k and 152k tokens: 64, 128-256, 128-512), the
  largest such that divides the vocabulary if one does (151,936: 128). A padded last block
  costs: at 32 x 151,936 the draw and its logprob took 32 ms in blocks of 512 against 3 in 128."""
  want = int(min(512, max(32, 2**round(math.log2(vocab) / 2))))
  return next((w for w in (want, want // 2, want // 4) if w >= 32 and vocab % w == 0), want)


# Index finding by floating-point reductions only: XLA:CPU runs integer reductions (argmax's (value,
# index) pair, a count of bools) unvectorised, ~20 ms over 32 x 151,936 against 0.4-3 ms for a
# float max or sum on this CPU. Counts and indices below 2^24 are exact in fp32.


def _count(mask):
  """mask [.., N] bool -> [..] int32: how many are set."""
  return jnp.sum(mask, axis=-1, dtype=jnp.float32).astype(jnp.int32)


def _first(mask):
  """mask [.., N] bool, some set -> [..] int32: the first set index."""
  n = mask.shape[-1]
  return jnp.min(jnp.where(mask, jnp.arange(n, dtype=jnp.float32), n), axis=-1).astype(jnp.int32)


def _last_with_mass(mass):
  """mass [.., N] >= 0 -> [..] int32: the index of its last entry > 0."""
  return jnp.max(jnp.where(mass > 0, jnp.arange(mass.shape[-1], dtype=jnp.float32), -1), axis=-1).astype(jnp.int32)


def _blocks(x, fill):
  """x [B, V] -> [B, C, W]: blocks of block_width(V) tokens, the last padded with fill."""
  width = block_width(x.shape[-1])
  return jnp.pad(x, ((0, 0), (0, -x.shape[-1] % width)), constant_values=fill).reshape(x.shape[0], -1, width)


def greedy_tokens(logits):
  """logits [B, V] -> [B] int32: each row's first maximum, as jnp.argmax picks it, in blocks as
  the draw: the first block holding the row's maximum, then the first maximum in it (argmax: 21
  ms at 32 x 151,936 on this CPU)."""
  blocks = _blocks(logits, -jnp.inf)
  tops = jnp.max(blocks, axis=-1)  # [B, C]
  block = _first(tops == jnp.max(tops, axis=-1, keepdims=True))
  inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, W]
  return block * blocks.shape[-1] + _first(inside == jnp.max(inside, axis=-1, keepdims=True))


def inverse_cdf_sample(logits, rng):
  """logits [B, V] (-inf = excluded), rng one key, [B] keys or their [B] uniforms -> tokens [B]
  int32 drawn from softmax(logits).

  One uniform u per row against the running sum of e = exp(logits - max): the token is the first
  whose running sum exceeds u * total. A Gumbel-max draw (jax.random.categorical) needs V random
  numbers and two logs per row; this needs one random number and no log, ~3x cheaper per decode
  step on CPU. The running sum has two levels: over blocks of block_width(V) tokens' masses
  [B, V / W], which finds the block, then over that block's W tokens. One running sum over the
  whole vocabulary (XLA:CPU lowers cumsum as a tree of windowed sums) took 37 ms at 32 x 151,936
  on this CPU against 3.6 ms, and 0.09 against 0.04 ms at 32 x 512. Excluded tokens add 0 to
  the sums, so they are never drawn: where rounding leaves u * total at or past a sum's end, the
  pick is the last block, or token, with mass."""
  rows = logits.shape[0]
  blocks = _blocks(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), 0.0)  # [B, C, W]
  width = blocks.shape[-1]
  mass = jnp.sum(blocks, axis=-1)  # [B, C]
  ends = jnp.cumsum(mass, axis=-1)  # [B, C]: the running sum at each block's end
  u = rng if jnp.issubdtype(rng.dtype, jnp.floating) else uniforms(rng, rows)
  target = u * ends[:, -1]
  block = jnp.minimum(_count(ends <= target[:, None]), _last_with_mass(mass))
  before = jnp.where(block > 0, jnp.take_along_axis(ends, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
  inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, W]: the block's e
  pick = _count(jnp.cumsum(inside, axis=-1) <= (target - before)[:, None])
  return (block * width + jnp.minimum(pick, _last_with_mass(inside))).astype(jnp.int32)
