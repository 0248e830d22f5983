"""Blockwise attention (models.attention): the dense attention's outputs and gradients under packed,
padded, windowed and soft-capped masks, in the decoder too, with memory linear in the length."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hex.models.attention import SHARED, Segments, blockwise_attention
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy

TOL = dict(rtol=1e-5, atol=1e-5)


def dense_attention(q, keys, values, mask, scale, cap):
  """The [B, KV, G, T, S]-scores computation blockwise_attention replaces."""
  s = jnp.einsum("bhgqd,bhdk->bhgqk", q, keys) * scale
  if cap:
    s = jnp.tanh(s / cap) * cap
  p = jax.nn.softmax(jnp.where(mask[:, None, None], s, -1e30), axis=-1)
  return jnp.einsum("bhgqk,bhkd->bhgqd", p, values)


def packed_rows(t=37):
  """Row 0: sequences of 10 and 20 tokens then padding; row 1: one sequence filling the row."""
  segments, positions = np.zeros((2, t), np.int32), np.zeros((2, t), np.int32)
  segments[0, :10], positions[0, :10] = 1, np.arange(10)
  segments[0, 10:30], positions[0, 10:30] = 2, np.arange(20)
  segments[1], positions[1] = 1, np.arange(t)
  return segments, positions


def qkv(t, s, b=2, kv=2, g=3, hd=8, seed=0):
  rng = np.random.default_rng(seed)
  arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return arr(b, kv, g, t, hd), arr(b, kv, hd, s), arr(b, kv, s, hd)


def test_segments_mask_is_block_diagonal_causal_by_position():
  m = np.asarray(Segments.causal(jnp.array([[1, 1, 2, 2, 2, 0]]), jnp.array([[0, 1, 0, 1, 2, 0]])).dense())[0]
  expected = np.zeros((6, 6), bool)
  expected[0, 0] = expected[1, :2] = True
  expected[2, 2] = expected[3, 2:4] = expected[4, 2:5] = True
  np.testing.assert_array_equal(m, expected)
  windowed = np.asarray(Segments.causal(jnp.array([[1, 1, 1]]), jnp.array([[0, 1, 2]])).windowed(2).dense())[0]
  np.testing.assert_array_equal(windowed, [[1, 0, 0], [1, 1, 0], [0, 1, 1]])


def test_shared_keys_are_seen_by_every_sequence_of_their_row():
  """A row of two completions (ids 1, 2) continuing one prompt of two keys (SHARED, then padding)."""
  q_ids, q_pos = jnp.array([[1, 1, 2, 2, 0]]), jnp.array([[2, 3, 2, 3, 0]])
  k_ids, k_pos = jnp.concatenate([jnp.array([[SHARED, 0]]), q_ids], 1), jnp.concatenate([jnp.array([[1, 0]]), q_pos], 1)
  m = np.asarray(Segments(q_ids, q_pos, k_ids, k_pos).dense())[0]
  np.testing.assert_array_equal(m[:, :2], [[1, 0]] * 4 + [[0, 0]])  # every sequence sees the prompt, padding nothing
  np.testing.assert_array_equal(m[:, 2:], Segments.causal(q_ids, q_pos).dense()[0])


@pytest.mark.parametrize("window,cap,block", [(None, 0.0, 8), (5, 0.0, 8), (None, 3.0, 16), (5, 3.0, 64)])
def test_blockwise_matches_dense_attention_and_its_gradients(window, cap, block):
  segments, positions = packed_rows()
  mask = Segments.causal(segments, positions)
  mask = mask if window is None else mask.windowed(window)
  q, k, v = qkv(37, 37)
  valid = jnp.asarray(segments > 0)[:, None, None, :, None]  # padding queries see nothing: zeros vs a mean
  weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32) * valid
  blockwise = lambda q, k, v: blockwise_attention(q, k, v, mask, 0.3, cap, block)
  dense = lambda q, k, v: dense_attention(q, k, v, mask.dense(), 0.3, cap)
  np.testing.assert_allclose(jnp.where(valid, blockwise(q, k, v), 0), jnp.where(valid, dense(q, k, v), 0), **TOL)
  np.testing.assert_array_equal(jnp.where(valid, 0, blockwise(q, k, v)), 0)
  grads = [jax.jit(jax.grad(lambda *a, f=f: (f(*a) * weights).sum(), (0, 1, 2)))(q, k, v) for f in (blockwise, dense)]
  for ours, theirs in zip(*grads):
    np.testing.assert_allclose(ours, theirs, **TOL)


def test_blockwise_queries_against_a_longer_cache_of_other_keys():
  # a completion row [T] attending its group's prompt keys [P] and its own: positions order them
  p, t = 6, 9
  q, k, v = qkv(t, p + t)
  q_seg = np.ones((2, t), np.int32)
  q_seg[1, 7:] = 0
  k_seg = np.concatenate([np.array([[0, 0, 1, 1, 1, 1], [1] * 6]), q_seg], axis=1)
  prompt_pos = np.array([[0, 0, 0, 1, 2, 3], np.arange(6)])
  q_pos = prompt_pos[:, -1:] + 1 + np.arange(t)[None]
  mask = Segments(jnp.asarray(q_seg), jnp.asarray(q_pos), jnp.asarray(k_seg),
                  jnp.asarray(np.concatenate([prompt_pos, q_pos], axis=1)))
  dense = mask.dense()
  assert dense[0, 0].tolist() == [False] * 2 + [True] * 5 + [False] * 8  # prompt tokens and itself
  valid = jnp.asarray(q_seg > 0)[:, None, None, :, None]
  np.testing.assert_allclose(jnp.where(valid, blockwise_attention(q, k, v, mask, 0.3, block=4), 0),
                             jnp.where(valid, dense_attention(q, k, v, dense, 0.3, 0.0), 0), **TOL)


GEMMA_LIKE = dict(vocab_size=32, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, qk_norm=True,
                  norm_style="gemma", post_norms=True, sliding_window=3,
                  layer_types=("sliding", "full", "sliding", "full"), attn_logit_softcap=20.0, attention_block=4)


@pytest.mark.parametrize("scan", [False, True])
def test_decoder_with_segments_gives_the_dense_masks_logits(scan):
  policy = Policy.build(model_config(**GEMMA_LIKE, scan_layers=scan))
  params = policy.init(0)
  segments = np.array([[1] * 6 + [2] * 5 + [0] * 2, [1] * 13])  # row 0 packs two sequences
  positions = np.array([list(range(6)) + list(range(5)) + [0, 0], list(range(13))])
  tokens = jax.random.randint(jax.random.key(1), segments.shape, 3, 32)
  valid = segments > 0
  mask = Segments.causal(segments, positions)
  dense_logits, _ = policy.apply(params, tokens, positions, mask.dense())
  logits, _ = jax.jit(policy.apply)(params, tokens, positions, mask)
  np.testing.assert_allclose(logits[valid], dense_logits[valid], **TOL)


def test_blockwise_memory_grows_linearly_with_length():
  """XLA's temporary bytes for the gradient of one layer's attention at 1k, 2k and 4k tokens:
  dense scores are O(T^2) (16x from 1k to 4k), the blockwise tiles O(T)."""

  def temp_bytes(attend, t):
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1, 1, 2, t, 64), (1, 1, 64, t), (1, 1, t, 64)))
    mask = Segments.causal(jnp.ones((1, t), jnp.int32), jnp.arange(t)[None])
    grad = jax.grad(lambda q, k, v: attend(q, k, v, mask).sum(), (0, 1, 2))
    return jax.jit(grad).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

  blockwise = lambda q, k, v, m: blockwise_attention(q, k, v, m, 0.125, block=256)
  dense = lambda q, k, v, m: dense_attention(q, k, v, m.dense(), 0.125, 0.0)
  ours = [temp_bytes(blockwise, t) for t in (1024, 2048, 4096)]
  theirs = [temp_bytes(dense, t) for t in (1024, 2048, 4096)]
  assert theirs[2] / theirs[0] > 8  # quadratic (and some linear terms)
  assert ours[2] / ours[0] < 5  # linear, with fixed tile buffers
  assert ours[2] < theirs[2] / 20
