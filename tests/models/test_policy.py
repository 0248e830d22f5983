import jax
import numpy as np
from flax import nnx

from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.decoder import Decoder
from jaxrl_hex.models.policy import Policy, _key_data

CFG = model_config(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)


def test_init_gives_nnx_seeded_weights_in_the_asked_shardings_with_one_program_for_every_seed(pools):
  policy = Policy.build(CFG)
  shardings = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
  for seed in (0, 2**40 + 3):  # a seed past int32 as nnx.Rngs takes it
    got = policy.init(seed, shardings)
    # the weights init gave with the seed a constant of its program (before it was an input)
    want = jax.jit(lambda seed=seed: nnx.to_pure_dict(nnx.split(Decoder(CFG, nnx.Rngs(seed)))[1]))()
    for (path, a), b, s in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                               jax.tree.leaves(shardings)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
      assert a.sharding.is_equivalent_to(s, a.ndim)
  assert not np.array_equal(policy.init(1)["embed"], policy.init(2)["embed"])
  # the seed is an input: one program (one persistent-cache entry) for every seed
  lowered = lambda seed: jax.jit(policy._fresh).lower(_key_data(seed)).as_text()
  assert lowered(1) == lowered(12345)
