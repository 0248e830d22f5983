import jax
import numpy as np
import pytest

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.rl.batch import rl_batch, scoring_batch
from jaxrl_hex.rl.layout import token_logprobs
from jaxrl_hex.rollout.engine import Engine
from jaxrl_hex.sync.probe import tolerance_for

CFG = model_config(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                   tie_embeddings=True)
TOK = CharTokenizer("0123456789+=")
PROMPTS = ["1+2=", "47+38=", "5=", "99+99+9="]  # different lengths: left padding is exercised


@pytest.fixture(scope="module")
def setup(pools):
  policy = Policy.build(CFG)
  train_params = policy.init(0, pools["train"].shardings_for(policy.logical_axes(), policy.shapes()))
  engine = Engine(policy, pools["rollout"], TOK, max_new_tokens=8, temperature=1.3)
  engine.load_weights(7, jax.device_put(train_params, engine.param_shardings))
  return policy, train_params, engine


def test_engine_logprobs_equal_trainer_logprobs(setup, pools):
  policy, train_params, engine = setup
  rollout = engine.generate(PROMPTS, 4, jax.random.key(0))
  rollout.rewards = np.zeros(len(rollout.group_ids), np.float32)
  batch = rl_batch(rollout)
  logp, _ = jax.jit(lambda p, b: token_logprobs(policy, p, b, temperature=1.3))(train_params, batch)
  mask = rollout.completion_mask
  assert mask.sum() > 20
  diff = np.abs(np.asarray(logp)[mask] - rollout.behaviour_logprobs[mask]).max()
  assert diff <= 1e-4


def test_bf16_engine_logprobs_agree_with_the_trainer_within_the_probes_tolerance(pools):
  """bf16 compute (fp32 weights): the engine's decode and the trainer's forward round at different
  places, so they agree within the gap the logprob probe allows bf16, not fp32's 1e-4."""
  cfg = CFG.copy_and_resolve_references()
  cfg.dtype = "bfloat16"
  policy = Policy.build(cfg)
  train_params = policy.init(0, pools["train"].shardings_for(policy.logical_axes(), policy.shapes()))
  engine = Engine(policy, pools["rollout"], TOK, max_new_tokens=8, temperature=1.0)
  engine.load_weights(0, jax.device_put(train_params, engine.param_shardings))
  rollout = engine.generate(PROMPTS, 4, jax.random.key(0))
  logp, _ = jax.jit(lambda p, b: token_logprobs(policy, p, b))(train_params, scoring_batch(rollout))
  mask = rollout.completion_mask
  assert mask.sum() > 20
  assert np.abs(np.asarray(logp)[mask] - rollout.behaviour_logprobs[mask]).max() <= tolerance_for(0.02, cfg.dtype)


def test_outputs_stop_at_eos_and_carry_the_version(setup):
  _, _, engine = setup
  rollout = engine.generate(PROMPTS, 4, jax.random.key(1))
  mask, comp = rollout.completion_mask, rollout.completion
  assert rollout.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
  for row_mask, row in zip(mask, comp):
    n = int(row_mask.sum())
    assert row_mask[:n].all() and not row_mask[n:].any()  # a prefix
    eos = np.flatnonzero(row[:n] == TOK.eos_id)
    assert (n == 8 and eos.size == 0) or eos.tolist() == [n - 1]  # stops right after EOS
    assert (row[n:] == 0).all()
  assert set(np.unique(rollout.versions[mask])) == {7}
  assert (rollout.versions[~mask] == -1).all()


def test_same_rng_same_samples_and_greedy_is_deterministic(setup):
  _, _, engine = setup
  a = engine.generate(PROMPTS, 2, jax.random.key(5))
  b = engine.generate(PROMPTS, 2, jax.random.key(5))
  np.testing.assert_array_equal(a.completion, b.completion)
  compiled = engine.compile_count
  g1 = engine.generate(PROMPTS, 2, jax.random.key(1), greedy=True)
  g2 = engine.generate(PROMPTS, 2, jax.random.key(2), greedy=True)
  assert engine.compile_count == compiled  # the temperature is an input: greedy runs the sampled programs
  np.testing.assert_array_equal(g1.completion, g2.completion)
  np.testing.assert_array_equal(g1.completion[0::2], g1.completion[1::2])  # a group is identical


def test_slots_that_do_not_divide_the_data_axis_are_refused(setup, pools):
  policy, _, _ = setup
  with pytest.raises(UserError,
                     match=r"rollout.slots=3 must be a positive multiple of pool 'rollout' batch axes \(2 ways\)"):
    Engine(policy, pools["rollout"], TOK, max_new_tokens=8, slots=3)


def test_more_rows_than_slots_and_rows_that_do_not_divide_the_data_axis(setup):
  _, _, engine = setup
  rollout = engine.generate(PROMPTS[:3], 1, jax.random.key(0))  # 3 rows on 64 slots
  assert rollout.completion.shape == (3, 8) and rollout.completion_mask[:, 0].all()
  small = Engine(engine.policy, engine.pool, TOK, max_new_tokens=8, slots=2)
  small.load_weights(7, engine.params)
  rollout = small.generate(PROMPTS, 2, jax.random.key(0))  # 8 rows through 2 slots
  assert rollout.completion_mask[:, 0].all() and rollout.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
