import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hex.config import base_config
from jaxrl_hex.errors import UserError
from jaxrl_hex.rl import advantages
from jaxrl_hex.rl.advantages import ADVANTAGES, AdvantageInputs

ALGO = base_config().algo


def _outcome(rewards, groups):
  """One completion token per sequence carrying its reward."""
  r = jnp.array(rewards)[:, None]
  return AdvantageInputs(r, jnp.ones_like(r), jnp.array(groups))


def test_grpo_matches_hand_computed_groups():
  adv, returns = advantages.grpo(_outcome([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [0, 0, 0, 0, 1, 1]), ALGO)
  std = np.sqrt(0.1875)  # group 0: mean 0.25, population std
  np.testing.assert_allclose(adv[:, 0], [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 0, 0], atol=1e-5)
  assert returns is None


def test_grpo_groups_need_not_be_contiguous():
  adv, _ = advantages.grpo(_outcome([2.0, 5.0, 4.0, 1.0], [7, 3, 7, 3]), ALGO)
  np.testing.assert_allclose(adv[:, 0], [-1.0, 1.0, 1.0, -1.0], atol=1e-5)


def test_drgrpo_subtracts_the_group_mean_only():
  adv, _ = advantages.drgrpo(_outcome([1.0, 0.0, 0.0, 0.0, 3.0, 1.0], [0, 0, 0, 0, 1, 1]), ALGO)
  np.testing.assert_allclose(adv[:, 0], [0.75, -0.25, -0.25, -0.25, 1.0, -1.0], atol=1e-6)


def test_rloo_baseline_is_the_mean_of_the_others():
  adv, _ = advantages.rloo(_outcome([1.0, 0.0, 0.0, 0.0, 2.0, 1.0], [0, 0, 0, 0, 1, 1]), ALGO)
  # sample 0: 1 - mean(0, 0, 0) = 1; sample 1: 0 - mean(1, 0, 0) = -1/3; pair: 2 - 1, 1 - 2
  np.testing.assert_allclose(adv[:, 0], [1.0, -1 / 3, -1 / 3, -1 / 3, 1.0, -1.0], atol=1e-6)


def test_group_advantages_cover_only_completion_tokens():
  inp = AdvantageInputs(jnp.array([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
                        jnp.array([0, 0]))
  adv, _ = advantages.drgrpo(inp, ALGO)
  np.testing.assert_allclose(adv, [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]], atol=1e-6)


def test_discounted_cumsum():
  x = jnp.array([[-0.1, 0.0, 1.0], [0.0, -0.2, 0.0]])
  np.testing.assert_allclose(advantages.discounted_cumsum(x, 0.5), [[0.15, 0.5, 1.0], [-0.1, -0.2, 0.0]], atol=1e-6)


def test_reinforce_pp_whitens_returns_to_go_over_the_batch():
  # token rewards: outcome on the last token, KL penalties on others; gamma 1
  inp = AdvantageInputs(jnp.array([[-0.1, 0.0, 1.0], [0.0, -0.2, 0.0]]), jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
                        jnp.array([0, 1]))
  adv, _ = advantages.reinforce_pp(inp, ALGO)
  returns = np.array([0.9, 1.0, 1.0, -0.2, -0.2])  # masked entries; mean 0.5, var 0.328
  expected = (returns - 0.5) / (np.sqrt(0.328) + 1e-6)
  np.testing.assert_allclose(np.asarray(adv)[np.asarray(inp.mask) > 0], expected, rtol=1e-5)
  assert adv[1, 2] == 0.0


def test_gae_hand_computed_and_ignores_padding():
  algo = base_config().algo
  algo.gamma, algo.gae_lambda = 1.0, 0.5
  inp = AdvantageInputs(jnp.array([[0.0, 0.0, 1.0, 0.0]]), jnp.array([[1.0, 1.0, 1.0, 0.0]]), jnp.array([0]),
                        values=jnp.array([[0.5, 0.6, 0.8, 9.0]]))
  adv, returns = advantages.gae(inp, algo)
  # delta = [0.1, 0.2, 0.2]; A = [0.1 + 0.5 * 0.3, 0.2 + 0.5 * 0.2, 0.2] = [0.25, 0.3, 0.2]
  np.testing.assert_allclose(returns, [[0.75, 0.9, 1.0, 0.0]], atol=1e-6)
  std = np.sqrt(0.005 / 3)
  np.testing.assert_allclose(adv, [[0.0, 0.05 / std, -0.05 / std, 0.0]], atol=1e-4)


def test_registry_resolves_names_user_functions_and_lists_known_ones():
  assert ADVANTAGES.get("rloo").fn is advantages.rloo
  assert ADVANTAGES.get("jaxrl_hex.rl.advantages:grpo").fn is advantages.grpo
  ADVANTAGES.register("test_zero", lambda inp, algo: (inp.mask * 0, None), needs_groups=False)
  adv, _ = ADVANTAGES.get("test_zero").fn(_outcome([1.0, 2.0], [0, 0]), ALGO)
  np.testing.assert_array_equal(adv, 0.0)
  with pytest.raises(
      UserError,
      match=r"algo.advantage='nope' is not a known advantage estimator; known: drgrpo, gae, grpo, reinforce_pp, rloo"):
    ADVANTAGES.get("nope")


def test_registered_properties_are_declared_fields():
  assert ADVANTAGES.get("grpo").needs_groups and ADVANTAGES.get("gae").needs_critic
  assert not ADVANTAGES.get("jaxrl_hex.rl.advantages:gae").needs_critic  # named directly: the defaults
  with pytest.raises(TypeError, match="needs_group"):
    ADVANTAGES.register("typo", advantages.grpo, needs_group=True)
  assert "typo" not in ADVANTAGES.names()
