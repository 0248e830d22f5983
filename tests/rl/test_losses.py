import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hex.rl import losses


def _loss(logp, prox, behav, adv, mask, cap=5.0, mode="mask"):
  return losses.decoupled_ppo(jnp.array(logp), jnp.array(prox), jnp.array(behav), jnp.array(adv),
                              jnp.array(mask), 0.2, 0.28, cap, mode)


def test_decoupled_ppo_hand_computed():
  # one sequence, three tokens; advantage +1
  logp = np.log([[0.5, 0.9, 0.2]])
  prox = np.log([[0.4, 0.6, 0.25]])
  behav = np.log([[0.4, 0.3, 0.25]])
  loss, m = _loss(logp, prox, behav, [1.0], [[True, True, True]])
  u = np.array([0.5 / 0.4, 0.9 / 0.6, 0.2 / 0.25])        # 1.25, 1.5, 0.8
  w = np.array([1.0, 0.6 / 0.3, 1.0])                     # behaviour weights
  obj = w * np.minimum(u, np.clip(u, 0.8, 1.28))          # clip-high at 1.28
  np.testing.assert_allclose(loss, -obj.mean(), rtol=1e-6)
  np.testing.assert_allclose(m["clip_fraction"], 1 / 3, rtol=1e-6)  # only token 1 (u = 1.5) clipped


def test_negative_advantage_clips_low_and_mask_excludes_padding():
  logp = np.log([[0.3, 0.5]])
  prox = np.log([[0.5, 0.5]])
  loss, m = _loss(logp, prox, prox, [-2.0], [[True, False]])
  # u = 0.6 < 0.8: min(0.6 * -2, 0.8 * -2) = -1.6; padding token ignored
  np.testing.assert_allclose(loss, 1.6, rtol=1e-6)
  np.testing.assert_allclose(m["clip_fraction"], 1.0)


def test_behaviour_weight_cap_masks_or_truncates():
  logp = prox = np.log([[0.6, 0.6]])
  behav = np.log([[0.06, 0.6]])  # first token: weight 10 > cap 5
  masked, _ = _loss(logp, prox, behav, [1.0], [[True, True]], mode="mask")
  truncated, _ = _loss(logp, prox, behav, [1.0], [[True, True]], mode="truncate")
  np.testing.assert_allclose(masked, -1.0, rtol=1e-6)            # only token 2 counts
  np.testing.assert_allclose(truncated, -(5.0 + 1.0) / 2, rtol=1e-6)


def test_gradient_is_weighted_policy_gradient_inside_clip():
  prox = jnp.log(jnp.array([[0.5, 0.25]]))
  behav = jnp.log(jnp.array([[0.25, 0.25]]))
  f = lambda lp: losses.decoupled_ppo(lp, prox, behav, jnp.array([3.0]), jnp.ones((1, 2)), 0.2, 0.28, 5.0)[0]
  g = jax.grad(f)(prox)  # u = 1: d/dlogp of -w*u*A/2 = -w*A/2
  np.testing.assert_allclose(g, [[-2.0 * 3.0 / 2, -1.0 * 3.0 / 2]], rtol=1e-6)


def test_k3_is_zero_at_equal_policies_and_positive_elsewhere():
  lp = jnp.log(jnp.array([0.5, 0.2]))
  np.testing.assert_allclose(losses.kl_k3(lp, lp), 0.0, atol=1e-7)
  ref = jnp.log(jnp.array([0.25, 0.4]))
  r = np.log([0.25 / 0.5, 0.4 / 0.2])
  np.testing.assert_allclose(losses.kl_k3(lp, ref), np.exp(r) - 1 - r, rtol=1e-6)
