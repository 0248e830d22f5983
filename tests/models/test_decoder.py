import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hex.models import Policy, causal_mask, init_cache
from jaxrl_hex.models.config import model_config, param_count

CFG = model_config(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, tie_embeddings=False, qkv_bias=True)


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
  wq_train = train["layers"][0]["attn"]["wq"].spec   # (embed, heads, head_dim)
  wq_rollout = rollout["layers"][0]["attn"]["wq"].spec
  assert tuple(wq_train) == ("fsdp", "tensor", None)
  assert tuple(wq_rollout) == (None, "tensor", None)
  params = policy.init(0, train)
  assert params["embed"].sharding == train["embed"]
  assert len(params["embed"].sharding.device_set) == 4
