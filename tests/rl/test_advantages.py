import jax.numpy as jnp
import numpy as np

from jaxrl_hex.rl import advantages


def test_grpo_matches_hand_computed_groups():
  rewards = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
  groups = jnp.array([0, 0, 0, 0, 1, 1])
  adv = advantages.grpo(rewards, groups, eps=0.0 + 1e-6)
  # group 0: mean 0.25, population std sqrt(0.1875) = 0.4330127
  std = np.sqrt(0.1875)
  expected = [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 0.0, 0.0]
  np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-5)


def test_grpo_groups_need_not_be_contiguous():
  adv = advantages.grpo(jnp.array([2.0, 5.0, 4.0, 1.0]), jnp.array([7, 3, 7, 3]), eps=1e-6)
  np.testing.assert_allclose(adv, [-1.0, 1.0, 1.0, -1.0], atol=1e-5)
