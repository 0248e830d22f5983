"""Config checks, reward shaping, KL-in-reward and DAPO dynamic sampling."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import load_config

from jaxrl_hex import cli
from jaxrl_hex.data.rollouts import Rollout, concat_rollouts
from jaxrl_hex.errors import ConfigError
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.rl import packing
from jaxrl_hex.rl.batch import TrainBatch
from jaxrl_hex.rl.dynamic import GroupFilter
from jaxrl_hex.rl.layout import Rows, from_layout, token_logprobs
from jaxrl_hex.rl.objectives import StartInputs, make_rl_loss
from jaxrl_hex.runtime import validate

PRESETS = ["grpo", "drgrpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo"]


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_load_and_validate(preset):
  cfg = load_config(f"configs/{preset}.py")
  validate(cfg)
  make_rl_loss(cfg.algo, cfg.rollout.temperature)


def _cli_error(capsys, tmp_path, *flags):
  assert cli.main(["train", f"--workdir={tmp_path}", *flags]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("jaxrl-hex: error: ") and "\n" not in err, err
  return err


def test_unknown_estimator_and_loss_list_the_known_ones(capsys, tmp_path):
  err = _cli_error(capsys, tmp_path, "--config.algo.advantage=ppo")
  assert "algo.advantage='ppo' is not a known advantage estimator" in err
  assert all(name in err for name in ("drgrpo", "gae", "grpo", "reinforce_pp", "rloo"))
  err = _cli_error(capsys, tmp_path, "--config.algo.loss=clip")
  assert "known: cispo, dual_clip, gspo, ppo" in err


def test_ppo_without_a_critic_says_why(capsys, tmp_path):
  err = _cli_error(capsys, tmp_path, "--config.algo.advantage=gae")
  assert "needs a learned critic" in err and "algo.critic.lr=1e-4" in err and "reinforce_pp" in err


def test_group_size_one_fails_for_group_baselines_only():
  cfg = load_config(**{"rollout.group_size": 1, "rollout.prompts_per_step": 8})
  with pytest.raises(ConfigError,
                     match="group_size=1 with algo.advantage='grpo': a group baseline from a single sample"):
    validate(cfg)
  cfg.algo.advantage = "reinforce_pp"
  validate(cfg)


def test_other_bad_choices():
  with pytest.raises(ConfigError, match="algo.kl_estimator='k4'; use one of k1, k2, k3"):
    validate(load_config(**{"algo.kl_estimator": "k4"}))
  with pytest.raises(ConfigError, match="algo.minibatches=3 must be >= 1 and divide the batch of 256"):
    validate(load_config(**{"algo.minibatches": 3}))


def test_overlong_shaping_is_dapo_soft_punishment():
  objective = make_rl_loss(load_config(**{"algo.overlong_buffer": 2, "algo.overlong_penalty": 0.5}).algo, 1.0)
  shaped = objective.shaped_rewards(jnp.ones(4), jnp.array([3.0, 4.0, 5.0, 6.0]), 6)
  np.testing.assert_allclose(shaped, [1.0, 1.0, 0.75, 0.5])  # lengths past 6 - 2 lose 0.5 per 2 tokens


def test_kl_as_reward_penalty_enters_reinforce_pp_returns(pools):
  """k1(behav, ref) is charged per token: with gamma 1 a sequence's return at token t is its outcome
  minus the KL of tokens t.. (the reference's logprobs computed here independently)."""
  cfg = load_config(**{
      "algo.advantage": "reinforce_pp",
      "algo.kl_coef": 0.5,
      "algo.kl_mode": "reward",
      "algo.kl_estimator": "k1"
  })
  policy = Policy.build(model_config(**cfg.model))
  params = policy.init(0)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 14, (4, 10)).astype(np.int32)
  valid = np.ones((4, 10), bool)
  valid[:, 7:] = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
  loss_mask = valid[:, 6:]
  batch = TrainBatch(tokens=tokens, valid=valid, loss_mask=loss_mask, rewards=np.array([1.0, 0.0, 1.0, 0.0],
                                                                                       np.float32),
                     behav_logp=np.where(loss_mask, -2.0,
                                         0.0).astype(np.float32), group_ids=np.arange(4, dtype=np.int32))
  ref_logp = np.asarray(token_logprobs(policy, params, batch)[0])
  lay = packing.plan(tokens, valid, loss_mask, pack=True, row_length=16)
  rows = Rows(*(jnp.asarray(x) for x in (lay.tokens, lay.positions, lay.segments, lay.seq)))
  objective = make_rl_loss(cfg.algo, 1.0)
  data, metrics = jax.jit(
      lambda p, b: objective.start(policy, None, StartInputs(p, rows, b, lay.slot, lay.minibatch_of, ref_params=p)))(
          params, batch)
  kl = np.where(loss_mask, -2.0 - ref_logp, 0.0)
  token_rewards = -0.5 * kl
  token_rewards[np.arange(4), loss_mask.sum(1) - 1] += batch.rewards
  returns = np.cumsum(token_rewards[:, ::-1], 1)[:, ::-1][loss_mask]
  expected = (returns - returns.mean()) / (returns.std() + 1e-6)
  np.testing.assert_allclose(np.asarray(from_layout(data.advantages, lay.slot))[loss_mask], expected, rtol=1e-4)
  np.testing.assert_allclose(metrics["kl"], kl[loss_mask].mean(), rtol=1e-5)


def test_an_episode_reward_reaches_every_turn_when_observations_lie_between_them(pools):
  """The loss mask of an episode has gaps (observations): the reward still lands on its last
  trained token, so GRPO gives every model token of the episode its group-normalised reward."""
  cfg = load_config()
  policy = Policy.build(model_config(**cfg.model))
  params = policy.init(0)
  tokens = np.random.default_rng(0).integers(1, 14, (4, 12)).astype(np.int32)
  valid = np.ones((4, 12), bool)
  loss_mask = np.zeros((4, 8), bool)  # two turns with an observation between them, then padding
  loss_mask[:, [0, 1, 4, 5]] = True
  valid[:, 4 + 6:] = False
  loss_mask[:, 6:] = False
  rewards = np.array([1.0, 0.0, 1.0, 1.0], np.float32)
  batch = TrainBatch(tokens=tokens, valid=valid, loss_mask=loss_mask, rewards=rewards, behav_logp=np.zeros(
      (4, 8), np.float32), group_ids=np.array([0, 0, 1, 1], np.int32))
  lay = packing.plan(tokens, valid, loss_mask)
  rows = Rows(*(jnp.asarray(x) for x in (lay.tokens, lay.positions, lay.segments, lay.seq)))
  objective = make_rl_loss(cfg.algo, 1.0)
  data, metrics = jax.jit(
      lambda p, b: objective.start(policy, None, StartInputs(p, rows, b, lay.slot, lay.minibatch_of)))(params, batch)
  adv = np.asarray(from_layout(data.advantages, lay.slot))
  np.testing.assert_allclose(adv[0][loss_mask[0]], 1.0, rtol=1e-4)  # group 0: rewards 1, 0 -> +1, -1
  np.testing.assert_allclose(adv[1][loss_mask[1]], -1.0, rtol=1e-4)
  assert (adv[2:] == 0).all() and (adv[~loss_mask] == 0).all()  # group 1 has no spread; observations none
  np.testing.assert_allclose(metrics["reward_mean"], 0.75)


def _rollout(rewards, group_ids, p_len):
  n = len(rewards)
  return Rollout(np.full((n, p_len), 3, np.int32), np.ones((n, p_len), bool), np.zeros((n, 2), np.int32),
                 np.ones((n, 2), bool), np.zeros((n, 2), np.float32), np.zeros((n, 2), np.int32), np.asarray(group_ids),
                 np.asarray(rewards, np.float32))


def test_dynamic_sampling_keeps_informative_groups_until_full():
  f = GroupFilter(prompts_per_step=2, max_rounds=5)
  assert f.add(_rollout([1, 1, 0, 1], [7, 7, 8, 8], p_len=3)) is None  # group 7 all-equal: dropped
  batch, stats = f.add(_rollout([0, 0, 1, 0], [9, 9, 4, 4], p_len=5))
  np.testing.assert_array_equal(batch.rewards, [0, 1, 1, 0])  # groups 8 and 4
  np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1])
  assert batch.prompt_tokens.shape == (4, 5) and batch.prompt_valid[:2, :2].sum() == 0  # re-left-padded
  assert stats == {"dynamic_sampling_rounds": 2, "informative_group_fraction": 0.5, "uninformative_groups_used": 0}


def test_dynamic_sampling_tops_up_after_max_rounds():
  f = GroupFilter(prompts_per_step=2, max_rounds=2)
  assert f.add(_rollout([1, 1, 0, 0], [1, 1, 2, 2], p_len=3)) is None
  batch, stats = f.add(_rollout([1, 0, 1, 1], [3, 3, 4, 4], p_len=3))
  np.testing.assert_array_equal(batch.rewards, [1, 0, 1, 1])
  assert stats["uninformative_groups_used"] == 1


def test_concat_rollouts_pads_prompts_left():
  out = concat_rollouts([_rollout([1], [0], 2), _rollout([0], [1], 4)])
  np.testing.assert_array_equal(out.prompt_valid, [[False, False, True, True], [True] * 4])
