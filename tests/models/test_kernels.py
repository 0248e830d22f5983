"""The platform attention kernels (models.kernels), run on CPU in Pallas interpret mode: the values
and gradients of blockwise attention on packed, padded GQA rows, under a mesh too, and the portable
path wherever a kernel would compute something else."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from models.test_attention import GEMMA_LIKE, TOL, dense_attention, packed_rows, qkv

from jaxrl_hex import meshes
from jaxrl_hex.models import kernels
from jaxrl_hex.models.attention import Segments, blockwise_attention
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.decoder import init_cache
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.sharding import activation_sharding

FACTS = dict(keys_are_queries=True, cap=0.0, windowed=False, head_dim=8, block=16)


def run_kernel(platform, f):
  """f(kernel) for the GPU (Triton) or TPU (Mosaic) kernel, interpreted on CPU: the Mosaic
  kernel only has the global interpret mode, which its backward pass must be traced under too."""
  interpret = pltpu.force_tpu_interpret_mode() if platform == "tpu" else contextlib.nullcontext()
  with interpret:
    return f(kernels.kernel_for(platform, **FACTS, interpret=True))


def values_and_grads(attend, weights, q, k, v):
  """attend(q, k, v) and the gradients of (attend(q, k, v) * weights).sum(), in one program."""

  def both(q, k, v):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(weights)

  return jax.jit(both)(q, k, v)


@pytest.mark.parametrize("platform,t", [("gpu", 37), ("tpu", 150)])  # tpu: tiles of 128, so 2 of them at 150
def test_kernel_gives_blockwise_and_dense_values_and_gradients(platform, t):
  segments, positions = packed_rows(t)  # row 0: two sequences then padding; row 1: one; GQA: 2 KV heads x 3
  mask = Segments.causal(segments, positions)
  q, k, v = qkv(t, t)
  valid = jnp.asarray(segments > 0)[:, None, None, :, None]
  weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32) * valid
  seg = jnp.asarray(segments)
  out, grads = run_kernel(platform,
                          lambda kernel: values_and_grads(lambda q, k, v: kernel(q, k, v, seg, 0.3), weights, q, k, v))
  blockwise = lambda q, k, v: blockwise_attention(q, k, v, mask, 0.3, block=16)
  dense = lambda q, k, v: jnp.where(valid, dense_attention(q, k, v, mask.dense(), 0.3, 0.0), 0)
  for reference in (blockwise, dense):  # padding queries: zeros
    their_out, their_grads = values_and_grads(reference, weights, q, k, v)
    np.testing.assert_allclose(out, their_out, **TOL)
    for ours, theirs in zip(grads, their_grads):
      np.testing.assert_allclose(ours, theirs, **TOL)


def test_kernel_for_is_none_exactly_where_a_kernel_computes_something_else():
  applies = lambda platform, **facts: kernels.kernel_for(platform, **dict(FACTS, **facts)) is not None
  assert applies("gpu") and applies("tpu") and applies("tpu", head_dim=256) and applies("gpu", head_dim=96)
  for platform in ("gpu", "tpu"):
    assert not applies(platform, keys_are_queries=False)  # a completion reading its group's prompt cache, decode
    assert not applies(platform, cap=50.0)  # soft-capped scores (Gemma 2)
    assert not applies(platform, windowed=True)  # sliding layers
  assert not applies("tpu", head_dim=192)  # the Mosaic kernel: head_dim <= 128 or a multiple of 128
  assert not applies("cpu")


def test_shard_mapped_kernel_on_a_2x2_mesh_equals_the_unsharded_kernel():
  pool = meshes.Pool(meshes.PoolSpec("train", (0, 1, 2, 3), {"data": 2, "tensor": 2}, meshes.DEFAULT_RULES))
  segments, _ = packed_rows(32)
  q, k, v = qkv(32, 32)
  seg = jnp.asarray(segments)
  weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32) * (seg > 0)[:, None, None, :, None]
  kernel = kernels.kernel_for("gpu", **FACTS, interpret=True)
  attend = lambda q, k, v: kernel(q, k, v, seg, 0.3)
  with activation_sharding(pool.activation_sharding):  # rows over data, KV heads over tensor
    assert "shard_map" in str(jax.make_jaxpr(attend)(q, k, v))
    out, grads = values_and_grads(attend, weights, q, k, v)
  assert out.sharding.spec[:2] == ("data", "tensor")
  unsharded_out, unsharded_grads = values_and_grads(attend, weights, q, k, v)
  np.testing.assert_allclose(out, unsharded_out, **TOL)
  for ours, theirs in zip(grads, unsharded_grads):
    np.testing.assert_allclose(ours, theirs, **TOL)


SMALL_GQA = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                 attention_block=16)
SEGMENTS = np.array([[1] * 6 + [2] * 5 + [0] * 2, [1] * 13])  # row 0 packs two sequences
POSITIONS = np.array([list(range(6)) + list(range(5)) + [0, 0], list(range(13))])


def decoder_logits(fields, cache_len=None):
  """(jitted logits of the policy on packed rows as a function of its params, the policy);
  cache_len: a prefill into a fresh cache this long."""
  policy = Policy.build(model_config(**fields))
  tokens = jax.random.randint(jax.random.key(1), SEGMENTS.shape, 3, 32)
  mask = Segments.causal(SEGMENTS, POSITIONS)
  cache = None if cache_len is None else init_cache(policy.cfg, 2, cache_len)
  return jax.jit(lambda params: policy.apply(params, tokens, POSITIONS, mask, cache)[0]), policy


def runs_a_kernel(logits, policy) -> bool:
  return "pallas_call" in str(jax.make_jaxpr(logits)(policy.shapes()))


def test_decoder_with_the_kernel_gives_the_portable_logits():
  logits, policy = decoder_logits(dict(SMALL_GQA, attention_kernel="pallas"))
  assert runs_a_kernel(logits, policy)
  portable, _ = decoder_logits(dict(SMALL_GQA, attention_kernel="portable"))
  params, valid = policy.init(0), SEGMENTS > 0
  np.testing.assert_allclose(logits(params)[valid], portable(params)[valid], **TOL)


@pytest.mark.parametrize(
    "fields,cache_len,kernel",
    [
        (dict(SMALL_GQA, attention_kernel="pallas", scan_layers=True), None, True),
        (dict(SMALL_GQA, attention_kernel="pallas"), 13, True),  # a fresh prompt's prefill: the cache holds the row
        (dict(SMALL_GQA, attention_kernel="pallas"), 20, False),  # keys beyond the row's tokens
        (dict(SMALL_GQA, attention_kernel="auto"), None, False),  # auto: the portable path on CPU
        (dict(SMALL_GQA, attention_kernel="portable"), None, False),
        (dict(GEMMA_LIKE, attention_kernel="pallas"), None, False),  # sliding windows and a soft-cap
        (dict(GEMMA_LIKE, attention_kernel="pallas", attn_logit_softcap=0.0, scan_layers=True), None, False),  # windows
    ])
def test_decoder_runs_a_kernel_where_asked_and_it_applies(fields, cache_len, kernel):
  assert runs_a_kernel(*decoder_logits(fields, cache_len)) == kernel


def test_a_mask_not_made_causal_keeps_the_portable_path():
  # the same rule as Segments.causal's, but nothing says the keys are the queries (e.g. a completion
  # reading its group's prompt cache builds its own)
  segments, positions = packed_rows()
  q, k, v = qkv(37, 37)
  made = {False: Segments(segments, positions, segments, positions), True: Segments.causal(segments, positions)}
  for kernel, mask in made.items():
    attend = lambda q, k, v, mask=mask: kernels.attention(q, k, v, mask, 0.3, 0.0, 16, "pallas", False)
    assert ("pallas_call" in str(jax.make_jaxpr(attend)(q, k, v))) == kernel
