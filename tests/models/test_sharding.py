"""Activation sharding constraints (models.sharding): by logical axes through the pool's rules,
only while a caller traces under activation_sharding, and left out where a dim does not divide."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxrl_hex import meshes
from jaxrl_hex.models.attention import Segments
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.sharding import activation_sharding, constrain

AXES = ("batch", "length", "act_embed")


def pool(rules=None):
  return meshes.Pool(
      meshes.PoolSpec("train", tuple(range(8)), {
          "data": 2,
          "fsdp": 2,
          "tensor": 2
      }, dict(meshes.DEFAULT_RULES, **(rules or {}))))


def out_spec(fn, x):
  return jax.jit(fn).lower(x).compile().output_shardings.spec


def test_constrain_splits_the_batch_over_every_batch_axis_under_a_pool():
  p = pool()
  x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32, sharding=p.replicated())

  def traced(x):
    with activation_sharding(p.activation_sharding):
      return constrain(x * 2, AXES)

  assert out_spec(traced, x) == PartitionSpec(("data", "fsdp"))
  assert out_spec(lambda x: constrain(x * 2, AXES), x) == PartitionSpec()  # no caller's pool: as XLA likes


def test_a_dim_that_does_not_divide_is_left_unconstrained():
  p = pool()
  assert p.activation_sharding(AXES, (8, 16, 32)).spec == PartitionSpec(("data", "fsdp"), None, None)
  assert p.activation_sharding(AXES, (6, 16, 32)) is None  # 6 rows over 4 batch ways


def test_sequence_parallelism_splits_the_residual_over_the_sequence_with_the_same_numbers():
  """A pool whose rules map length to tensor (Megatron-style sequence parallelism) holds the
  residual stream [B, T/tensor, d] between blocks and gives the same loss and gradients."""
  policy = Policy.build(
      model_config(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                   scan_layers=True, remat="full", attention_block=4))
  params = policy.init(0)
  tokens = jax.random.randint(jax.random.key(1), (4, 16), 3, 32)
  positions = jnp.broadcast_to(jnp.arange(16), (4, 16))
  segments = jnp.ones((4, 16), jnp.int32)

  def loss(params):
    logits, _ = policy.apply(params, tokens, positions, Segments.causal(segments, positions))
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

  out, specs = {}, {}
  for sp in (False, True):
    p = pool({"length": ("tensor",)} if sp else {})
    sharded = jax.device_put(params, p.shardings_for(policy.logical_axes(), policy.shapes()))
    with activation_sharding(p.activation_sharding):
      step = jax.jit(jax.value_and_grad(loss))
      out[sp] = step(sharded)
      hlo = step.lower(sharded).compile().as_text()
    specs[sp] = p.activation_sharding(AXES, (4, 16, 32)).spec
  assert specs[False] == PartitionSpec(("data", "fsdp"), None, None)
  assert specs[True] == PartitionSpec(("data", "fsdp"), "tensor", None)
  assert "reduce-scatter" in hlo or "all-to-all" in hlo  # the block outputs land split over the sequence
  np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(out[True][1]), jax.tree.leaves(out[False][1])):
    np.testing.assert_allclose(a, b, atol=1e-5)
