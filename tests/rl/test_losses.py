import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxrl_hex.config import base_config
from jaxrl_hex.rl import losses
from jaxrl_hex.rl.aggregation import AGGREGATIONS
from jaxrl_hex.rl.losses import LOSSES, LossInputs, behaviour_weight


def _algo(**overrides):
  algo = base_config().algo
  algo.update(overrides)
  return algo


def _loss(name, logp, prox, behav, adv, mask, agg="token-mean", **overrides):
  """Scalar loss of `name` aggregated by `agg`, and its per-token metrics averaged over tokens."""
  algo = _algo(**overrides)
  inp = LossInputs.padded(jnp.asarray(logp, jnp.float32), jnp.asarray(prox, jnp.float32),
                          jnp.asarray(behav, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.asarray(mask))
  inp.behav_weight, _ = behaviour_weight(inp, algo.behav_weight_cap, algo.behav_weight_mode, algo.behav_weight_level)
  per_token, metrics = LOSSES.get(name).fn(inp, algo)
  weights = AGGREGATIONS.get(agg).fn(inp.mask, algo)
  return (weights * per_token).sum(), {k: float((v * inp.mask).sum() / inp.mask.sum()) for k, v in metrics.items()}


def test_ppo_decoupled_hand_computed():
  logp, prox, behav = np.log([[0.5, 0.9, 0.2]]), np.log([[0.4, 0.6, 0.25]]), np.log([[0.4, 0.3, 0.25]])
  loss, m = _loss("ppo", logp, prox, behav, [1.0], [[True, True, True]])
  # u = [1.25, 1.5, 0.8], w = [1, 2, 1]; clip-high at 1.28 caps token 1
  np.testing.assert_allclose(loss, -(1.25 + 2 * 1.28 + 0.8) / 3, rtol=1e-6)
  np.testing.assert_allclose(m["clip_fraction"], 1 / 3, rtol=1e-6)


def test_ppo_negative_advantage_clips_low_and_mask_excludes_padding():
  logp, prox = np.log([[0.3, 0.5]]), np.log([[0.5, 0.5]])
  loss, m = _loss("ppo", logp, prox, prox, [-2.0], [[True, False]])
  np.testing.assert_allclose(loss, 1.6, rtol=1e-6)  # u = 0.6: min(-1.2, 0.8 * -2)
  np.testing.assert_allclose(m["clip_fraction"], 1.0)


@pytest.mark.parametrize(
    "mode, level, cap, expected",
    [
        ("mask", "token", 5.0, -(0.0 + 1.0) / 2),  # token 0: w = 10 > 5, zeroed (denominator keeps it)
        ("truncate", "token", 5.0, -(5.0 + 1.0) / 2),
        ("mask", "sequence", 20.0, -(10.0 + 10.0) / 2),  # sequence weight = 10 * 1 on both tokens
        ("mask", "sequence", 5.0, 0.0),
        ("truncate", "sequence", 5.0, -(5.0 + 5.0) / 2),
    ])
def test_behaviour_weight_cap_by_mode_and_level(mode, level, cap, expected):
  logp = prox = np.log([[0.6, 0.6]])
  behav = np.log([[0.06, 0.6]])
  loss, _ = _loss("ppo", logp, prox, behav, [1.0], [[True, True]], behav_weight_mode=mode, behav_weight_level=level,
                  behav_weight_cap=cap)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_dual_clip_floors_negative_advantages():
  logp, prox = np.log([[0.5, 0.5]]), np.log([[0.1, 0.1]])  # u = 5
  loss, m = _loss("dual_clip", logp, prox, prox, [[-1.0, 1.0]], [[True, True]], dual_clip_c=3.0)
  # A = -1: ppo objective min(-5, -1.28) = -5, floored at 3 * -1 = -3; A = +1: min(5, 1.28)
  np.testing.assert_allclose(loss, -(-3.0 + 1.28) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["dual_clip_fraction"], 0.5)
  ppo, _ = _loss("ppo", logp, prox, prox, [[-1.0, 1.0]], [[True, True]])
  np.testing.assert_allclose(ppo, -(-5.0 + 1.28) / 2, rtol=1e-6)


def test_gspo_uses_the_sequence_ratio_and_its_gradient():
  prox = jnp.log(jnp.array([[0.5, 0.5], [0.4, 0.4]]))
  logp = prox + jnp.log(jnp.array([[1.1, 1.3], [1.0, 1.0]]))
  mask = jnp.ones((2, 2), bool)
  f = lambda lp: _loss("gspo", lp, prox, prox, [1.0, -2.0], mask, agg="seq-mean-token-mean")[0]
  s = np.sqrt(1.1 * 1.3)  # geometric mean of the token ratios: inside [0.8, 1.28]
  np.testing.assert_allclose(f(logp), -(s * 1.0 + 1.0 * -2.0) / 2, rtol=1e-6)
  # d/dlogp_t of -(1/2) s_i A_i with s_i = exp(mean_t log u_t): -(1/2) A_i s_i / 2 per token
  np.testing.assert_allclose(jax.grad(f)(logp), [[-s / 4, -s / 4], [0.5, 0.5]], rtol=1e-5)


def test_gspo_clipped_sequence_has_no_gradient():
  prox = jnp.log(jnp.array([[0.25, 0.25]]))
  logp = prox + jnp.log(2.0)  # s = 2 > 1.28 with A > 0
  f = lambda lp: _loss("gspo", lp, prox, prox, [1.0], jnp.ones((1, 2), bool), agg="seq-mean-token-mean")[0]
  np.testing.assert_allclose(f(logp), -1.28, rtol=1e-6)
  np.testing.assert_allclose(jax.grad(f)(logp), 0.0, atol=1e-7)


def test_cispo_keeps_a_clipped_stop_gradient_weight_on_every_token():
  prox = jnp.log(jnp.array([[0.4, 0.4]]))
  logp = prox + jnp.log(jnp.array([[1.5, 0.5]]))  # u = [1.5, 0.5] -> weights [1.28, 0.8]
  f = lambda lp: _loss("cispo", lp, prox, prox, [2.0], jnp.ones((1, 2), bool))[0]
  np.testing.assert_allclose(f(logp), -(1.28 * 2 * logp[0, 0] + 0.8 * 2 * logp[0, 1]) / 2, rtol=1e-6)
  np.testing.assert_allclose(jax.grad(f)(logp), [[-1.28, -0.8]], rtol=1e-6)  # clipped tokens still learn
  assert _loss("cispo", logp, prox, prox, [2.0], jnp.ones((1, 2), bool))[1]["clip_fraction"] == 1.0


def test_ppo_gradient_inside_the_clip_is_the_weighted_policy_gradient():
  prox = jnp.log(jnp.array([[0.5, 0.25]]))
  behav = jnp.log(jnp.array([[0.25, 0.25]]))
  g = jax.grad(lambda lp: _loss("ppo", lp, prox, behav, [3.0], jnp.ones((1, 2), bool))[0])(prox)
  np.testing.assert_allclose(g, [[-2.0 * 3.0 / 2, -1.0 * 3.0 / 2]], rtol=1e-6)  # -w A / 2


def _random_case():
  rng = np.random.default_rng(0)
  prox = jnp.log(jnp.asarray(rng.uniform(0.2, 0.8, (3, 4)), jnp.float32))
  behav = prox + jnp.asarray(rng.uniform(-0.3, 0.3, (3, 4)), jnp.float32)
  logp = prox + jnp.asarray(rng.uniform(-0.1, 0.1, (3, 4)), jnp.float32)  # ratios inside the clip
  mask = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], bool)
  return logp, prox, behav, mask, jnp.array([1.5, -0.7, 0.4])


@pytest.mark.parametrize("name", ["ppo", "dual_clip"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradients_match_finite_differences(name, agg):
  logp, prox, behav, mask, adv = _random_case()
  f = lambda lp: _loss(name, lp, prox, behav, adv, mask, agg=agg, clip_eps_low=0.3, clip_eps_high=0.3)[0]
  check_grads(f, (logp,), order=1, modes=["rev"], eps=1e-3, atol=2e-3, rtol=2e-3)


def test_gspo_token_form_has_the_gradient_of_the_sequence_objective():
  """With a sequence-level behaviour weight, the stop-gradient token form differentiates like
  GSPO's sequence objective -mean_i w_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log u_t);
  finite differences of that objective check it."""
  logp, prox, behav, mask, adv = _random_case()
  m = mask.astype(jnp.float32)
  w = jnp.exp(((prox - behav) * m).sum(1))  # the sequence's behaviour weight, below the cap

  def sequence_objective(lp):
    s = jnp.exp(((lp - prox) * m).sum(1) / m.sum(1))
    obj = jnp.minimum(s * adv, jnp.clip(s, 0.7, 1.3) * adv)
    return -(w * obj).mean()

  token_form = lambda lp: _loss("gspo", lp, prox, behav, adv, mask, agg="seq-mean-token-mean", behav_weight_level=
                                "sequence", clip_eps_low=0.3, clip_eps_high=0.3)[0]
  check_grads(sequence_objective, (logp,), order=1, modes=["rev"], eps=1e-3, atol=2e-3, rtol=2e-3)
  np.testing.assert_allclose(token_form(logp), sequence_objective(logp), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(token_form)(logp) * m, jax.grad(sequence_objective)(logp), atol=1e-5)


def test_kl_estimators_hand_computed():
  lp, ref = jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))
  np.testing.assert_allclose(losses.kl_k1(lp, ref), [np.log(2)], rtol=1e-6)
  np.testing.assert_allclose(losses.kl_k2(lp, ref), [0.5 * np.log(2)**2], rtol=1e-6)
  np.testing.assert_allclose(losses.kl_k3(lp, ref), [0.5 - 1 + np.log(2)], rtol=1e-6)
  for kl in losses.KL_ESTIMATORS.values():
    np.testing.assert_allclose(kl(lp, lp), 0.0, atol=1e-7)
  # gradients w.r.t. log pi at pi = ref: k1 -> 1, k2 -> 0, k3 -> 0
  np.testing.assert_allclose(jax.grad(lambda x: losses.kl_k1(x, lp).sum())(lp), [1.0])
  np.testing.assert_allclose(jax.grad(lambda x: losses.kl_k3(x, lp).sum())(lp), [0.0], atol=1e-7)


def test_value_loss_is_clipped_around_the_old_value():
  np.testing.assert_allclose(losses.value_loss(jnp.array(1.0), jnp.array(0.5), jnp.array(2.0), 0.2),
                             0.5 * (0.7 - 2.0)**2, rtol=1e-6)  # max((1-2)^2, (0.7-2)^2)
  np.testing.assert_allclose(losses.value_loss(jnp.array(0.6), jnp.array(0.5), jnp.array(2.0), 0.2), 0.5 * 1.4**2,
                             rtol=1e-6)  # inside the clip: plain squared error


def test_unknown_loss_lists_the_known_ones():
  with pytest.raises(ValueError,
                     match="algo.loss='ppo2' is not a known policy loss; known: cispo, dual_clip, gspo, ppo"):
    LOSSES.get("ppo2")
