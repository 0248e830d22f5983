"""Activation sharding constraints (models.sharding): by logical axes through the pool's rules,
only while a caller traces under activation_sharding, and left out where a dim does not divide."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl_hex import meshes
from jaxrl_hex.models.sharding import activation_sharding, constrain

AXES = ("batch", "length", "act_embed")


def pool():
  return meshes.Pool(
      meshes.PoolSpec("train", tuple(range(8)), {
          "data": 2,
          "fsdp": 2,
          "tensor": 2
      }, meshes.DEFAULT_RULES))


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
