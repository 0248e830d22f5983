import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hex.models.attention import Segments
from jaxrl_hex.models.config import model_config, param_count
from jaxrl_hex.models.decoder import causal_mask, init_cache
from jaxrl_hex.models.policy import Policy

CFG = model_config(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                   tie_embeddings=False, qkv_bias=True)


def test_param_count_matches_built_model():
  policy = Policy.build(CFG)
  assert sum(x.size for x in jax.tree.leaves(policy.shapes())) == param_count(CFG)


def test_kv_cached_decode_equals_full_recompute():
  policy = Policy.build(CFG)
  params = policy.init(0)
  tokens = jax.random.randint(jax.random.key(1), (3, 10), 3, 32)
  valid = jnp.ones((3, 10), bool).at[1, :3].set(False)  # row 1 is left-padded
  positions = jnp.maximum(jnp.cumsum(valid, 1) - 1, 0)
  full, _ = policy.apply(params, tokens, positions, causal_mask(valid))

  prefix = 6
  cache = init_cache(CFG, 3, 10)
  mask = (jnp.arange(10)[None, :] <= jnp.arange(prefix)[:, None])[None] & valid[:, None, :]
  mask = mask & (jnp.arange(10) < prefix)[None, None, :]
  logits, cache = policy.apply(params, tokens[:, :prefix], positions[:, :prefix], mask, cache, 0)
  steps = [logits]
  for t in range(prefix, 10):
    step_mask = (valid & (jnp.arange(10) <= t))[:, None, :]
    logits, cache = policy.apply(params, tokens[:, t:t + 1], positions[:, t:t + 1], step_mask, cache, t)
    steps.append(logits)
  cached = jnp.concatenate(steps, axis=1)
  rows = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(cached)[rows], np.asarray(full)[rows], atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_real_tokens():
  policy = Policy.build(CFG)
  params = policy.init(0)
  seq = jax.random.randint(jax.random.key(2), (1, 5), 3, 32)
  plain, _ = policy.apply(params, seq, jnp.arange(5)[None], causal_mask(jnp.ones((1, 5), bool)))
  padded_tokens = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), seq], 1)
  valid = jnp.arange(8)[None] >= 3
  positions = jnp.maximum(jnp.cumsum(valid, 1) - 1, 0)
  padded, _ = policy.apply(params, padded_tokens, positions, causal_mask(valid))
  np.testing.assert_allclose(padded[:, 3:], plain, atol=1e-5)


def test_sharded_params_follow_logical_axes(pools):
  policy = Policy.build(CFG)
  train = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
  rollout = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  wq_train = train["layers"][0]["attn"]["wq"].spec  # (embed, heads, head_dim)
  wq_rollout = rollout["layers"][0]["attn"]["wq"].spec
  assert tuple(wq_train) == ("fsdp", "tensor", None)
  assert tuple(wq_rollout) == (None, "tensor", None)
  params = policy.init(0, train)
  assert params["embed"].sharding == train["embed"]
  assert len(params["embed"].sharding.device_set) == 4


GEMMA_LIKE = model_config(vocab_size=32, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                          tie_embeddings=True, qk_norm=True, norm_style="gemma", post_norms=True,
                          mlp_activation="gelu_tanh", embed_scale=32**0.5, query_pre_attn_scalar=12.0,
                          attn_logit_softcap=5.0, final_logit_softcap=3.0, sliding_window=4,
                          layer_types=("sliding", "sliding", "full"), rope_local_theta=100.0, rope_scaling={
                              "rope_type": "linear",
                              "factor": 2.0
                          })


def test_param_count_covers_every_family_feature():
  policy = Policy.build(GEMMA_LIKE)
  assert sum(x.size for x in jax.tree.leaves(policy.shapes())) == param_count(GEMMA_LIKE)
  # per layer: q/k/v/o 32*(32+16+16) + 32*32, MLP 3*32*64, 4 norms of 32, q/k norms of 8
  assert param_count(GEMMA_LIKE) == 3 * (2048 + 1024 + 6144 + 128 + 16) + 32 * 32 + 32


def test_sliding_window_decode_through_a_ring_cache_equals_full_recompute():
  """The rollout engine keeps each sequence in consecutive slots of a ring: sliding windows must
  measure distance modulo the ring, and RoPE uses true positions wherever a key sits."""
  policy = Policy.build(GEMMA_LIKE)
  params, apply = policy.init(0), jax.jit(policy.apply)
  n = 10
  tokens = jax.random.randint(jax.random.key(3), (2, n), 3, 32)
  positions = jnp.broadcast_to(jnp.arange(n), (2, n))
  full, _ = policy.apply(params, tokens, positions, causal_mask(jnp.ones((2, n), bool)))
  cache, start = init_cache(GEMMA_LIKE, 2, n), 7  # token t lives in slot (start + t) % n
  steps = []
  for t in range(n):
    slot_of = (start + jnp.arange(t + 1)) % n
    valid = jnp.zeros((2, n), bool).at[:, slot_of].set(True)
    logits, cache = apply(params, tokens[:, t:t + 1], positions[:, t:t + 1], valid[:, None, :], cache, (start + t) % n)
    steps.append(logits)
  np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5, rtol=0)
  key_positions = jnp.broadcast_to((jnp.arange(n) - start) % n, (2, n))  # the same, told explicitly
  last, _ = apply(params, tokens[:, -1:], positions[:, -1:], jnp.ones((2, 1, n), bool), cache, (start + n - 1) % n,
                  key_positions)
  np.testing.assert_allclose(last, full[:, -1:], atol=1e-5, rtol=0)


def test_sliding_window_changes_what_long_sequences_see():
  params = Policy.build(GEMMA_LIKE).init(0)
  wide = Policy.build(model_config(**dict(GEMMA_LIKE, sliding_window=64)))
  tokens = jax.random.randint(jax.random.key(4), (1, 12), 3, 32)
  args = (tokens, jnp.arange(12)[None], causal_mask(jnp.ones((1, 12), bool)))
  narrow_out, wide_out = Policy.build(GEMMA_LIKE).apply(params, *args)[0], wide.apply(params, *args)[0]
  np.testing.assert_allclose(narrow_out[:, :4], wide_out[:, :4], atol=1e-6)  # inside the window: equal
  assert np.abs(narrow_out[:, 4:] - wide_out[:, 4:]).max() > 1e-3


@pytest.mark.parametrize("field, value, message", [
    ("norm_style", "layer", "norm_style='layer'; use one of"),
    ("layer_types", ("full",), "layer_types=.* once per layer"),
    ("rope_scaling", {
        "rope_type": "yarn",
        "factor": 2.0
    }, "rope_scaling.rope_type='yarn'; supported"),
    ("rope_scaling", {
        "rope_type": "llama3",
        "factor": 2.0
    }, r"lacks \['low_freq_factor'"),
])
def test_model_config_refuses_what_the_decoder_cannot_do(field, value, message):
  with pytest.raises(ValueError, match=message):
    model_config(**dict(GEMMA_LIKE, **{field: value}))


@pytest.mark.parametrize("cfg", [CFG, GEMMA_LIKE], ids=["untied", "tied_softcap"])
def test_hidden_states_through_the_head_are_apply_logits(cfg):
  """apply_hidden then logits (whole, or a slice of the vocabulary, as the trainer's chunked
  logprobs and the critic read them) is apply, to the bit."""
  policy = Policy.build(cfg)
  params = policy.init(0)
  tokens = jax.random.randint(jax.random.key(5), (2, 7), 3, 32)
  args = (tokens, jnp.broadcast_to(jnp.arange(7), (2, 7)), causal_mask(jnp.ones((2, 7), bool)))
  logits, _ = policy.apply(params, *args)
  hidden, _ = policy.apply_hidden(params, *args)
  assert hidden.shape == (2, 7, 32) and hidden.dtype == jnp.float32
  np.testing.assert_array_equal(policy.logits(params, hidden), logits)
  np.testing.assert_allclose(policy.logits(params, hidden[:, 2:5]), logits[:, 2:5], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(policy.logits(params, hidden, columns=slice(0, 1)), logits[..., :1], rtol=1e-6, atol=1e-6)
  if cfg.final_logit_softcap:
    assert np.abs(np.asarray(logits)).max() <= cfg.final_logit_softcap


BF16 = CFG.copy_and_resolve_references()
BF16.dtype = "bfloat16"  # compute; the weights stay fp32


def test_bf16_dense_attention_rounds_where_the_blockwise_path_does():
  """The dense path (an engine's decode steps) keeps scores and sums in fp32 as the blockwise path
  (the trainer's forward) does, so in bf16 a sequence through either mask is the same to the bit."""
  policy = Policy.build(BF16)
  params = policy.init(0)
  tokens = jax.random.randint(jax.random.key(2), (2, 24), 3, 32)
  valid = jnp.ones((2, 24), bool).at[1, :5].set(False)
  positions = jnp.maximum(jnp.cumsum(valid, 1) - 1, 0)
  dense, _ = policy.apply(params, tokens, positions, causal_mask(valid))
  blockwise, _ = policy.apply(params, tokens, positions, Segments.causal(valid, positions))
  np.testing.assert_array_equal(np.asarray(dense)[np.asarray(valid)], np.asarray(blockwise)[np.asarray(valid)])


def test_bf16_logits_are_accumulated_and_returned_in_fp32():
  """Not rounded to bf16, whose spacing at a trained model's top logits would land on every logprob."""
  policy = Policy.build(BF16)
  params = policy.init(0)
  hidden = jax.random.normal(jax.random.key(3), (4, 32)).astype(jnp.bfloat16) * 40
  logits = policy.logits(params, hidden)
  head = np.asarray(params["lm_head"]).astype(jnp.bfloat16).astype(np.float64)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, np.asarray(hidden, np.float64) @ head, rtol=1e-5, atol=1e-5)
