import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hex.config import base_config
from jaxrl_hex.rl.aggregation import AGGREGATIONS, minibatch_weights

MASK = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
LOSS = jnp.array([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])


@pytest.mark.parametrize(
    "name, norm, expected",
    [
        ("token-mean", 0, (1 + 2 + 4) / 3),
        ("seq-mean-token-mean", 0, ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", 0, ((1 + 2) / 3 + 4 / 3) / 2),  # divisor: the width C = 3
        ("seq-mean-token-sum-norm", 4, ((1 + 2) / 4 + 4 / 4) / 2),
    ])
def test_aggregations_hand_computed(name, norm, expected):
  algo = base_config().algo
  algo.loss_norm_length = norm
  np.testing.assert_allclose((AGGREGATIONS.get(name).fn(MASK, algo) * LOSS).sum(), expected, rtol=1e-6)


def test_empty_sequences_do_not_count():
  mask = jnp.concatenate([MASK, jnp.zeros((1, 3))])
  loss = jnp.concatenate([LOSS, jnp.ones((1, 3))])
  w = AGGREGATIONS.get("seq-mean-token-mean").fn(mask, base_config().algo)
  np.testing.assert_allclose((w * loss).sum(), 2.75, rtol=1e-6)


def test_minibatch_weights_normalise_within_each_minibatch():
  w = minibatch_weights(AGGREGATIONS.get("token-mean").fn, MASK, jnp.array([0, 1]), 2, base_config().algo)
  np.testing.assert_allclose(w, [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
