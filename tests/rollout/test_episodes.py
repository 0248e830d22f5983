"""Episodes of an environment through the engine: one sequence per episode, the model's tokens
trained and the observations context, rewards summed, faults confined to their episode."""
import time

import jax
import numpy as np
import pytest
from rollout.test_sessions import policy_weights

from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.rl.batch import rl_batch
from jaxrl_hex.rl.layout import token_logprobs
from jaxrl_hex.rollout.engine import Engine
from jaxrl_hex.rollout.episodes import EpisodeStream, episode_stats
from jaxrl_hex.tasks.environment import EnvTask, Step

CFG = model_config(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                   tie_embeddings=True)
TOK = CharTokenizer("0123456789+=")
RECORDS = [{"start": "12+"}, {"start": "7="}, {"start": "345+6="}]
TEMPERATURE = 1.3


class Count:
  """Answers every turn with '+<turn>='; done after `turns` turns, reward 0.5 per turn."""
  turns = 3

  def reset(self, record):
    self.n = 0
    return record["start"]

  def step(self, text):
    self.n += 1
    return Step(f"+{self.n}=", reward=0.5, done=self.n >= self.turns)


def task(env=Count, **kw) -> EnvTask:
  return EnvTask("count", RECORDS, RECORDS, env, tokenizer=TOK, **kw)


@pytest.fixture(scope="module")
def policy_params(pools):
  return policy_weights(CFG, pools["train"])


def engine(pools, policy_params, page=8, **kw):
  policy, params, _ = policy_params
  e = Engine(policy, pools["rollout"], TOK, max_new_tokens=40, temperature=TEMPERATURE, slots=8, max_prompt_len=16,
             steps_per_sync=3, kv_page_size=page, **kw)
  e.load_weights(7, jax.device_put(params, e.param_shardings))
  return e


@pytest.fixture(scope="module")
def shared(pools, policy_params):
  """shared() -> the paged engine the tests share (its programs compile once), idle, on weights v7;
  a new one when a test left it busy."""
  built = []

  def get():
    if not built or built[0].pending or built[0].held:
      built[:] = [engine(pools, policy_params)]
    e = built[0]
    e.load_weights(7, jax.device_put(policy_params[1], e.param_shardings))
    return e

  return get


def run(e, t, group=2, key=0):
  stream = EpisodeStream(e, t, turn_tokens=6)
  try:
    return stream.run(RECORDS, group, jax.random.key(key), [10, 11, 12])
  finally:
    stream.close()


@pytest.mark.parametrize("page", [8, 0], ids=["paged", "ring"])
def test_one_sequence_per_episode_model_tokens_trained_observations_context(pools, policy_params, shared, page):
  rollout, episodes = run(shared() if page else engine(pools, policy_params, page), task())
  assert rollout.group_ids.tolist() == [10, 10, 11, 11, 12, 12]
  for i, ep in enumerate(episodes):
    assert ep.row == i and ep.fault is None
    n = int(rollout.completion_valid[i].sum())
    assert rollout.completion_valid[i, :n].all() and not rollout.completion_valid[i, n:].any()
    row, model = rollout.completion[i, :n], rollout.completion_mask[i, :n]
    # turns end at EOS (or the turn cap of 6); the observations between them are exactly the env's text
    observations = [TOK.decode(row[j:k]) for j, k in _runs(~model)]
    assert observations == [f"+{t}=" for t in range(1, ep.turns)]
    assert ep.turns == 3 and rollout.turns[i] == 3 and rollout.rewards[i] == 1.5
    assert (rollout.versions[i][rollout.completion_mask[i]] == 7).all()
    assert (rollout.versions[i][rollout.context_mask[i]] == -1).all()
    assert (rollout.behaviour_logprobs[i][rollout.context_mask[i]] == 0).all()
    prompt = rollout.prompt_tokens[i][rollout.prompt_valid[i]].tolist()
    assert prompt == [TOK.bos_id] + TOK.encode(RECORDS[i // 2]["start"])
  stats = episode_stats(rollout)
  assert stats["episode_turns"] == 3 and stats["episode_faults"] == 0
  assert 0 < stats["env_token_share"] < 1


def _runs(mask):
  """[(start, end)] of the runs of True in a bool vector."""
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
  return list(zip(edges[::2], edges[1::2]))


def test_the_engine_and_the_trainer_agree_on_every_model_token(policy_params, shared):
  policy, params, _ = policy_params
  rollout, _ = run(shared(), task(), key=3)
  rollout.rewards = rollout.rewards.astype(np.float32)
  logp, _ = jax.jit(lambda p, b: token_logprobs(policy, p, b, temperature=TEMPERATURE))(params, rl_batch(rollout))
  mask = rollout.completion_mask
  assert mask.sum() > 40 and rollout.context_mask.sum() > 20
  assert np.abs(np.asarray(logp)[mask] - rollout.behaviour_logprobs[mask]).max() <= 1e-4


def test_new_weights_inside_an_episode_each_token_scored_by_its_version(pools, policy_params):
  """interrupt=recompute: weights switch at a hand-back in the middle of the episodes; every model
  token's behaviour logprob is its own version's (the trainer recomputes it with that version)."""
  policy, params, other = policy_params
  polls = []

  def source():
    polls.append(1)
    return (8, jax.device_put(other, e.param_shardings)) if len(polls) == 4 else None

  e = engine(pools, policy_params, weights_source=source)
  rollout, _ = run(e, task(), key=4)
  versions, mask = rollout.versions, rollout.completion_mask
  assert {7, 8} <= set(np.unique(versions[mask]).tolist())
  mixed = [i for i in range(len(mask)) if {7, 8} <= set(versions[i][mask[i]].tolist())]
  assert mixed, "no episode saw the switch"
  score = jax.jit(lambda p, b: token_logprobs(policy, p, b, temperature=TEMPERATURE)[0])
  batch = rl_batch(rollout)
  for version, p in ((7, params), (8, other)):
    pick = mask & (versions == version)
    assert np.abs(np.asarray(score(p, batch))[pick] - rollout.behaviour_logprobs[pick]).max() <= 1e-4
  for i in range(len(mask)):  # an episode's versions only go up
    assert (np.diff(versions[i][mask[i]]) >= 0).all()


class Broken(Count):
  """Episode by record: 7= answers the wrong type, 345+6= raises on its second turn."""

  def reset(self, record):
    self.kind = record["start"]
    return super().reset(record)

  def step(self, text):
    if self.kind == "7=":
      return "not a step"
    if self.kind == "345+6=" and self.n == 1:
      raise RuntimeError("the environment broke")
    return super().step(text)


def test_a_faulty_environment_ends_only_its_own_episodes_and_counts_them(shared):
  rollout, episodes = run(shared(), task(Broken))
  faults = [ep.fault for ep in episodes]
  assert faults[:2] == [None, None] and rollout.rewards[:2].tolist() == [1.5, 1.5]
  assert all("returned str, not a Step" in f for f in faults[2:4])
  assert all("raised RuntimeError: the environment broke" in f for f in faults[4:])
  assert rollout.faults.tolist() == [0, 0, 1, 1, 1, 1]
  assert rollout.turns.tolist() == [3, 3, 1, 1, 2, 2] and rollout.rewards[4:].tolist() == [0.5, 0.5]
  assert episode_stats(rollout)["episode_faults"] == 4


class Slow(Count):

  def step(self, text):
    time.sleep(5)
    return super().step(text)


def test_an_environment_that_hangs_is_left_behind_after_its_timeout(shared):
  e = shared()
  t0 = time.time()
  rollout, episodes = run(e, task(Slow, env_timeout_s=0.3))
  assert time.time() - t0 < 5
  assert all("did not answer in 0.3s" in ep.fault for ep in episodes)
  assert rollout.turns.tolist() == [1] * 6


class Chatty(Count):
  """An observation far over the episode's budget."""

  def step(self, text):
    return Step("+" * 50)


def test_an_observation_over_the_token_budget_truncates_its_episode(shared):
  rollout, episodes = run(shared(), task(Chatty))
  assert rollout.truncated.all() and rollout.faults.all()
  assert all("leaves no room in the episode's token budget" in ep.fault for ep in episodes)
  assert (rollout.context_mask.sum(1) == 0).all()  # nothing half-added


def test_chunks_of_several_batches_share_the_engine_and_each_episode_comes_back_once(shared):
  e = shared()
  stream = EpisodeStream(e, task(), turn_tokens=6)
  try:
    stream.submit("a", RECORDS[:2], 2, jax.random.key(1), [0, 1])
    stream.submit("b", RECORDS[2:], 3, jax.random.key(2), [2])
    done = {}
    while stream:
      for key, rollout in stream.advance(max_s=1.0, group_size=99):
        assert key not in done
        done[key] = rollout
  finally:
    stream.close()
  assert done["a"].group_ids.tolist() == [0, 0, 1, 1] and done["b"].group_ids.tolist() == [2, 2, 2]
  assert (done["a"].turns == 3).all() and (done["b"].turns == 3).all()
  # the same records and keys alone give the same episodes: they do not depend on what ran beside them
  stream = EpisodeStream(e, task(), turn_tokens=6)
  alone, _ = stream.run(RECORDS[2:], 3, jax.random.key(2), [2])
  stream.close()
  np.testing.assert_array_equal(alone.completion, done["b"].completion)
