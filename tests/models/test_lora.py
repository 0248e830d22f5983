"""LoRA adapters in the decoder: a fresh adapter changes nothing, merged equals unmerged, scanned
equals unrolled, the params split into adapters and base by path, and bad settings are refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hex.models import lora
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.decoder import causal_mask, stack_layers
from jaxrl_hex.models.policy import Policy

SHAPE = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 12)), jnp.int32)
POSITIONS = jnp.broadcast_to(jnp.arange(12), (2, 12))
MASK = causal_mask(jnp.ones((2, 12), bool))


def _policy(**lora_settings):
  return Policy.build(model_config(**SHAPE, lora=dict(dict(rank=4), **lora_settings)))


def _logits(policy, params, dropout_key=None):
  model = policy if dropout_key is None else policy.with_dropout(dropout_key)
  return jax.jit(lambda p: model.apply_hidden(p, TOKENS, POSITIONS, MASK)[0])(params)


def _random_b(adapters, seed=1):
  """Adapters whose B is random too (fresh ones have B = 0)."""
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  return jax.tree_util.tree_map_with_path(
      lambda p, x: 0.1 * jax.random.normal(next(keys), x.shape, x.dtype) if p[-1].key == "b" else x, adapters)


def test_every_projection_gets_an_adapter_with_logical_axes():
  policy = _policy()
  adapters, base = policy.split(policy.shapes())
  layer = adapters["layers"][0]
  assert sorted(layer["attn"]) == ["wk_lora", "wo_lora", "wq_lora", "wv_lora"]
  assert sorted(layer["mlp"]) == ["down_lora", "gate_lora", "up_lora"]
  assert layer["attn"]["wq_lora"]["a"].shape == (32, 4) and layer["attn"]["wq_lora"]["b"].shape == (4, 4, 8)
  assert layer["attn"]["wo_lora"]["a"].shape == (4, 8, 4) and layer["attn"]["wo_lora"]["b"].shape == (4, 32)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adapters))
  axes = policy.split(policy.logical_axes())[0]["layers"][0]
  assert axes["attn"]["wq_lora"] == {"a": ("qkv_embed", "lora_rank"), "b": ("lora_rank", "heads", "head_dim")}
  assert axes["mlp"]["down_lora"] == {"a": ("mlp", "lora_rank"), "b": ("lora_rank", "mlp_down_embed")}
  # the base is exactly the model without adapters
  assert jax.tree.structure(base) == jax.tree.structure(policy.base().shapes())
  assert jax.tree.map(lambda s: s.shape, base) == jax.tree.map(lambda s: s.shape, policy.base().shapes())


def test_targets_pick_projections_by_name_pattern():
  policy = _policy(targets=("q_proj", "mlp.*"))
  layer = policy.split(policy.shapes())[0]["layers"][0]
  assert sorted(layer["attn"]) == ["wq_lora"] and sorted(layer["mlp"]) == ["down_lora", "gate_lora", "up_lora"]


def test_adapters_shard_under_the_pools_rules(pools):
  policy = _policy()
  shardings = policy.split(pools["train"].shardings_for(policy.logical_axes(), policy.shapes()))[0]
  wq = shardings["layers"][0]["attn"]["wq_lora"]
  assert wq["a"].spec == jax.sharding.PartitionSpec("fsdp", None)  # the rank is never split
  assert wq["b"].spec == jax.sharding.PartitionSpec(None, "tensor", None)


@pytest.mark.parametrize("scan", [False, True])
def test_a_fresh_adapter_leaves_every_output_bit_identical(scan):
  policy = Policy.build(model_config(**SHAPE, scan_layers=scan, lora=dict(rank=4)))
  params = policy.init(0)
  adapters, base = policy.split(params)
  assert all(float(jnp.abs(v["b"]).max()) == 0.0 for v in jax.tree.leaves(adapters, is_leaf=lambda x: "b" in x))
  assert float(jnp.abs(jax.tree.leaves(adapters)[0]).max()) > 0  # A is random, B zero
  np.testing.assert_array_equal(_logits(policy, params), _logits(policy.base(), base))


@pytest.mark.parametrize("scan", [False, True])
def test_merged_weights_compute_what_the_adapters_do(scan):
  policy = Policy.build(model_config(**SHAPE, scan_layers=scan, lora=dict(rank=4, alpha=8.0)))
  adapters, base = policy.split(policy.init(0))
  params = lora.merge(_random_b(adapters), base)
  unmerged, merged = _logits(policy, params), _logits(policy.base(), lora.merged(params, policy.cfg))
  assert float(jnp.abs(unmerged - _logits(policy.base(), base)).max()) > 1e-2  # the adapters change the model
  np.testing.assert_allclose(unmerged, merged, atol=1e-5, rtol=1e-5)
  # merged leaves every untargeted weight as it was
  assert lora.merged(params, policy.cfg)["embed"] is base["embed"]


def test_scanned_and_unrolled_adapters_give_the_same_outputs():
  unrolled = _policy()
  params = lora.merge(*(lambda a, b: (_random_b(a), b))(*unrolled.split(unrolled.init(0))))
  scanned = Policy.build(model_config(**SHAPE, scan_layers=True, lora=dict(rank=4)))
  np.testing.assert_allclose(_logits(unrolled, params), _logits(scanned, stack_layers(params)), atol=1e-5, rtol=1e-5)


def test_dropout_acts_only_under_a_key_and_only_on_the_adapters():
  policy = _policy(dropout=0.5)
  adapters, base = policy.split(policy.init(0))
  params = lora.merge(_random_b(adapters), base)
  plain = _logits(policy, params)
  dropped = _logits(policy, params, jax.random.key(3))
  assert float(jnp.abs(dropped - plain).max()) > 1e-3
  np.testing.assert_array_equal(dropped, _logits(policy, params, jax.random.key(3)))  # one key, one mask
  # with a zero B the adapters add nothing, dropped or not
  fresh = lora.merge(adapters, base)
  np.testing.assert_array_equal(_logits(policy, fresh, jax.random.key(3)), _logits(policy, fresh))


def test_gradients_flow_to_the_adapters_through_the_frozen_base():
  policy = _policy()
  adapters, base = policy.split(policy.init(0))
  adapters = _random_b(adapters)
  loss = lambda a: jnp.sum(policy.apply_hidden(lora.merge(a, base), TOKENS, POSITIONS, MASK)[0]**2)
  grads = jax.grad(loss)(adapters)
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("settings, words", [
    (dict(rank=33), "model.lora.rank=33 is larger than"),
    (dict(rank=4, targets=("qq_proj",)), "model.lora.targets: ['qq_proj'] match(es) no layer"),
    (dict(rank=-1), "model.lora.rank=-1 must be >= 0"),
    (dict(rank=4, dropout=1.0), "model.lora.dropout=1.0 must be in [0, 1)"),
])
def test_bad_lora_settings_name_the_field(settings, words):
  with pytest.raises(ValueError) as e:
    model_config(**SHAPE, lora=settings)
  assert str(e.value).startswith(words)
