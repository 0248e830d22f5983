import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hex.rollout.sampling import sample, uniforms

LOGITS = jnp.array([[2.0, 1.0, 0.5, -1.0, 0.0]] * 2000)


def test_greedy_and_its_logprob():
  token, lp = sample(LOGITS[:1], jax.random.key(0), temperature=0.0)
  assert int(token[0]) == 0
  np.testing.assert_allclose(lp[0], jax.nn.log_softmax(LOGITS[0])[0], rtol=1e-6)


def test_a_runtime_temperature_draws_as_the_constant_one_and_zero_is_greedy():
  logits = jax.random.normal(jax.random.key(5), (64, 512)) * 3
  keys = jax.random.split(jax.random.key(6), 64)
  traced = jax.jit(lambda t: sample(logits, keys, t, top_k=50, top_p=0.9))
  for temperature in (0.0, 0.7, 1.0):
    want = sample(logits, keys, temperature, top_k=50, top_p=0.9)
    got = traced(np.float32(temperature))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_top_k_only_picks_the_k_best_and_reports_untruncated_logprob():
  tokens, lps = sample(LOGITS, jax.random.key(1), temperature=2.0, top_k=2)
  assert set(np.unique(tokens)) == {0, 1}
  full = jax.nn.log_softmax(LOGITS[0] / 2.0)
  np.testing.assert_allclose(lps, full[tokens], rtol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
  probs = jax.nn.softmax(LOGITS[0])  # ~[0.53, 0.20, 0.12, 0.03, 0.07]
  assert probs[0] < 0.6 < probs[0] + probs[1]
  tokens, _ = sample(LOGITS, jax.random.key(2), temperature=1.0, top_p=0.6)
  assert set(np.unique(tokens)) == {0, 1}
  share = float(np.mean(np.asarray(tokens) == 0))
  np.testing.assert_allclose(share, probs[0] / (probs[0] + probs[1]), atol=0.04)


def test_temperature_sampling_matches_the_distribution():
  tokens, _ = sample(LOGITS, jax.random.key(3), temperature=1.0)
  freq = np.bincount(np.asarray(tokens), minlength=5) / len(tokens)
  np.testing.assert_allclose(freq, jax.nn.softmax(LOGITS[0]), atol=0.035)


def test_top_p_bisection_keeps_the_same_set_as_a_full_sort():
  from jaxrl_hex.rollout.sampling import top_p_cutoff
  logits = jax.random.normal(jax.random.key(4), (64, 512)) * 3
  for top_p in (0.1, 0.5, 0.9, 0.99):
    kept = np.asarray(logits >= top_p_cutoff(logits, top_p))
    order = np.argsort(-np.asarray(logits), axis=-1)
    probs = np.take_along_axis(np.asarray(jax.nn.softmax(logits)), order, -1)
    n_keep = (np.cumsum(probs, -1) < top_p).sum(-1) + 1  # smallest prefix reaching top_p
    np.testing.assert_array_equal(kept.sum(-1), n_keep)


def test_min_p_drops_tokens_below_a_share_of_the_best():
  probs = jax.nn.softmax(LOGITS[0])  # ~[0.53, 0.20, 0.12, 0.03, 0.07]
  tokens, _ = sample(LOGITS, jax.random.key(5), temperature=1.0, min_p=0.2)  # keeps p >= 0.106
  assert set(np.unique(tokens)) == {0, 1, 2}
  share = np.bincount(np.asarray(tokens), minlength=5)[:3] / len(tokens)
  np.testing.assert_allclose(share, probs[:3] / probs[:3].sum(), atol=0.04)


def test_inverse_cdf_draw_follows_softmax_and_never_picks_excluded_tokens():
  from jaxrl_hex.rollout.sampling import inverse_cdf_sample
  row = jnp.array([-jnp.inf, 1.0, -jnp.inf, 0.0, 2.0, -jnp.inf])  # excluded first, middle and last
  tokens = np.asarray(inverse_cdf_sample(jnp.tile(row, (20000, 1)), jax.random.key(6)))
  freq = np.bincount(tokens, minlength=6) / len(tokens)
  assert freq[0] == freq[2] == freq[5] == 0
  np.testing.assert_allclose(freq, jax.nn.softmax(row), atol=0.012)  # ~3.5 sigma at 20k draws
  # rows draw independently: two identical rows do not always agree
  pair = np.asarray(inverse_cdf_sample(jnp.tile(row, (2, 1)), jax.random.key(7)))
  many = [np.asarray(inverse_cdf_sample(jnp.tile(row, (2, 1)), jax.random.key(s))) for s in range(40)]
  assert len(pair) == 2 and any(a != b for a, b in many)


def test_per_row_keys_make_a_row_draw_independent_of_its_batch():
  from jaxrl_hex.rollout.sampling import inverse_cdf_sample
  keys = jax.random.split(jax.random.key(8), 64)
  row = jnp.array([0.5, 1.0, 0.0, 2.0])
  alone = [int(inverse_cdf_sample(row[None], keys[i:i + 1])[0]) for i in range(8)]
  together = np.asarray(inverse_cdf_sample(jnp.tile(row, (64, 1)), keys))
  assert together[:8].tolist() == alone  # row i's draw is its key's, whatever rows share the batch
  drawn = inverse_cdf_sample(jnp.tile(row, (64, 1)), uniforms(keys, 64))  # the keys' uniforms drawn beforehand
  np.testing.assert_array_equal(drawn, together)
  freq = np.bincount(
      np.asarray(inverse_cdf_sample(jnp.tile(row, (20000, 1)), jax.random.split(jax.random.key(9), 20000))),
      minlength=4) / 20000
  np.testing.assert_allclose(freq, jax.nn.softmax(row), atol=0.012)


def test_the_two_level_draw_picks_the_token_a_flat_running_sum_does():
  from jaxrl_hex.rollout.sampling import block_width, inverse_cdf_sample
  vocab = 1000  # blocks of 32, the last padded by 8
  assert block_width(vocab) == 32 and block_width(151936) == 128 and block_width(131072) == 256 and block_width(
      512) == 32
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, (64, vocab)).astype(np.float32)
  logits[:, 64:128] = -np.inf  # two whole blocks excluded
  logits[:, rng.random(vocab) < 0.3] = -np.inf  # and tokens scattered everywhere, the last ones too
  logits[:, vocab - 50:] = -np.inf
  u = rng.random(64).astype(np.float32)
  u[:3] = [0.0, 1e-9, np.nextafter(np.float32(1), np.float32(0))]  # either end of [0, 1)
  e = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
  running = np.cumsum(e, -1)
  want = np.minimum((running <= u[:, None] * running[:, -1:]).sum(-1), vocab - 51)  # the last token with mass
  got = np.asarray(inverse_cdf_sample(jnp.asarray(logits), jnp.asarray(u)))
  np.testing.assert_array_equal(got, want)
  assert np.isfinite(logits[np.arange(64), got]).all()


def test_greedy_tokens_are_argmax_first_maximum_across_blocks():
  from jaxrl_hex.rollout.sampling import greedy_tokens
  rng = np.random.default_rng(1)
  for vocab in (6, 1000, 4096):  # one padded block, padded blocks of 32, whole blocks of 64
    logits = rng.normal(0, 1, (16, vocab)).astype(np.float32)
    logits[:, rng.random(vocab) < 0.2] = -np.inf
    logits[0, [vocab // 3, vocab - 1]] = 50.0  # a tie in two blocks: the first wins
    logits[1, [2, 3]] = 50.0  # a tie inside one block
    logits[2, -1] = 50.0  # the last token
    got = np.asarray(greedy_tokens(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, -1))
    assert got[0] == vocab // 3 and got[1] == 2 and got[2] == vocab - 1


def test_top_k_cutoff_is_the_kth_largest_logit_ties_counted():
  from jaxrl_hex.rollout.sampling import top_k_cutoff
  rng = np.random.default_rng(2)
  logits = np.round(rng.normal(0, 2, (8, 1000)), 1).astype(np.float32)  # blocks of 32; many ties
  logits[:, rng.random(1000) < 0.1] = -np.inf
  logits[0, :3] = logits[0, 500:503] = 30.0  # the top 6 tied in two blocks
  for k in (1, 3, 7, 20, 300):  # 7: over its blocks' tokens; 20, 300: over the whole row
    want = np.asarray(jax.lax.top_k(jnp.asarray(logits), k)[0][:, -1:])
    np.testing.assert_array_equal(np.asarray(top_k_cutoff(jnp.asarray(logits), k)), want)
  few = np.full((2, 1000), -np.inf, np.float32)
  few[:, [5, 900]] = [1.0, 2.0]  # fewer tokens than k: every one of them is kept
  assert (np.asarray(top_k_cutoff(jnp.asarray(few), 7)) <= 1.0).all()
