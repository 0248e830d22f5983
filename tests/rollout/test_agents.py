"""Agents written against the real `openai` client, trained through the rollout side's endpoint:
one token sequence per episode, the model's replies trained and the agent's messages context, the
endpoint's samples the engine's own, faults confined to their episode.

The tiny model is first taught the calculator task's demonstrations (a few seconds of supervised
steps on four records), so the ReAct agent's episodes call the tool and answer."""
import json
import os
import time

import jax
import numpy as np
import openai
import optax
import pytest
from support import ROOT

from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.rl.batch import rl_batch, sft_batch
from jaxrl_hex.rl.layout import token_logprobs
from jaxrl_hex.rollout.agents import AgentStream
from jaxrl_hex.rollout.engine import Engine, Request
from jaxrl_hex.specs import load_module
from jaxrl_hex.tasks import calculator
from jaxrl_hex.tasks.agent import AgentTask
from jaxrl_hex.tasks.environment import EnvTask

EXAMPLE = load_module(os.path.join(ROOT, "examples", "react_calculator.py"), "example")
TOK = CharTokenizer("0123456789*=<>/calcresultoe")
CFG = model_config(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                   tie_embeddings=True)
RECORDS = [{"a": 12, "b": 34}, {"a": 56, "b": 78}, {"a": 91, "b": 23}, {"a": 45, "b": 67}]
TEMP = 1.0


def task(agent=EXAMPLE.react, **kw) -> AgentTask:
  return AgentTask("react", RECORDS, RECORDS, agent,
                   **dict(dict(tools=[calculator.calc], tokenizer=TOK, demo=EXAMPLE.demo, max_turns=3), **kw))


@pytest.fixture(scope="module")
def engine(pools):
  """An engine with a model taught the calculator's demos (greedy: <calc>a*b</calc>, then the result)."""
  policy = Policy.build(CFG)
  params = policy.init(0, pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes()))
  env = EnvTask("calc", RECORDS, RECORDS, calculator.Multiply, tools=[calculator.calc], demo=calculator.demo,
                tokenizer=TOK)
  batch, tx = sft_batch(TOK, RECORDS, env), optax.adam(1e-2)
  loss = lambda p: -(token_logprobs(policy, p, batch)[0] * batch.loss_mask).sum() / batch.loss_mask.sum()

  def step(_, carry):
    p, state = carry
    updates, state = tx.update(jax.grad(loss)(p), state, p)
    return optax.apply_updates(p, updates), state

  # the 60 steps as one program: one compile (the step jitted alone compiled twice, for its first and later inputs)
  params, _ = jax.jit(lambda p: jax.lax.fori_loop(0, 60, step, (p, tx.init(p))))(params)
  e = Engine(policy, pools["rollout"], TOK, max_new_tokens=48, temperature=TEMP, slots=4, max_prompt_len=64,
             steps_per_sync=4, kv_page_size=8)
  e.load_weights(7, jax.device_put(params, e.param_shardings))
  return e


def run(engine, t, group=2, key=0, greedy=False, turn_tokens=24):
  stream = AgentStream(engine, t, turn_tokens=turn_tokens)
  engine.greedy = greedy
  try:
    rollout, episodes = stream.run(RECORDS, group, jax.random.key(key), [10, 11, 12, 13])
  finally:
    engine.greedy = False
    stream.close()
  assert engine.held == 0 and engine.pending == 0  # every session let go
  return rollout, episodes, stream


class Recorder:
  """The real client, each call's messages and response kept (logprobs asked for)."""

  def __init__(self, client, log):
    self.client, self.log, self.chat = client, log, self
    self.completions = self

  def create(self, **kw):
    response = self.client.chat.completions.create(logprobs=True, **kw)
    self.log.append((json.loads(json.dumps(kw["messages"],
                                           default=lambda m: m.model_dump(exclude_none=True))), response))
    return response


def row_of(client) -> int:
  """The Rollout row of the episode a client belongs to: a fresh stream numbers them from 1, in row order."""
  return int(str(client.base_url).rstrip("/").split("/")[-2]) - 1


def ids(response, choice=0) -> list[int]:
  """A choice's token ids, from its logprobs' tokens (the end-of-turn token reads as "")."""
  return [
      TOK.encode(t["token"])[0] if t["token"] else TOK.eos_id
      for t in response["choices"][choice]["logprobs"]["content"]
  ]


@pytest.fixture(scope="module")
def react_run(engine):
  """The example's ReAct agent on every record, twice, sampled; each episode's calls recorded by row."""
  logs = {}

  def agent(client, record):
    log = logs[row_of(client)] = []
    return EXAMPLE.react(Recorder(client, log), record)

  rollout, episodes, stream = run(engine, task(agent), key=1)
  return rollout, episodes, stream, logs


def test_react_episodes_are_one_sequence_each_model_tokens_trained_the_agents_messages_context(react_run):
  rollout, episodes, stream, logs = react_run
  assert rollout.group_ids.tolist() == [10, 10, 11, 11, 12, 12, 13, 13] and stream.faults == 0
  assert sorted(logs) == list(range(8))
  called = 0
  for row, ep in enumerate(episodes):
    assert ep.row == row and ep.fault is None and ep.done
    calls = logs[row]
    # the stitched sequence: the first call's prompt, then each call's completion and the next call's new messages
    want_prompt = [TOK.bos_id] + TOK.encode(calls[0][0][0]["content"])
    want, model = [], []
    for c, (messages, response) in enumerate(calls):
      if c:
        new = messages[len(calls[c - 1][0]) + 1:]
        delta = "".join(f"<result>{m['content']}</result>" if m["role"] == "tool" else m["content"] for m in new)
        want += TOK.encode(delta)
        model += [False] * len(TOK.encode(delta))
      got = ids(response.model_dump())
      want += got
      model += [True] * len(got)
    n = len(want)
    assert rollout.prompt_tokens[row][rollout.prompt_valid[row]].tolist() == want_prompt
    assert rollout.completion[row, :n].tolist() == want and not rollout.completion_valid[row, n:].any()
    assert rollout.completion_mask[row, :n].tolist() == model  # the loss mask: exactly the model's tokens
    assert rollout.context_mask[row, :n].tolist() == [not m for m in model]
    assert rollout.turns[row] == len(calls) and rollout.faults[row] == 0
    called += sum(bool(r.choices[0].message.tool_calls) for _, r in calls)
  assert called >= 4  # the taught model calls the tool
  assert rollout.tool_calls.sum() == called
  assert rollout.rewards.mean() > 0.5  # ... and copies its result


def test_logprobs_in_the_responses_are_the_rollouts_behaviour_logprobs_and_the_trainers(react_run, engine):
  rollout, _, _, logs = react_run
  for row in range(len(rollout.group_ids)):
    served = [t["logprob"] for _, r in logs[row] for t in r.model_dump()["choices"][0]["logprobs"]["content"]]
    np.testing.assert_allclose(rollout.behaviour_logprobs[row][rollout.completion_mask[row]], served, atol=1e-6)
  assert (rollout.versions[rollout.completion_mask] == 7).all() and (rollout.versions[rollout.context_mask] == -1).all()
  rollout.rewards = rollout.rewards.astype(np.float32)
  logp, _ = jax.jit(lambda p, b: token_logprobs(engine.policy, p, b, temperature=TEMP))(engine.params,
                                                                                        rl_batch(rollout))
  mask = rollout.completion_mask
  assert np.abs(np.asarray(logp)[mask] - rollout.behaviour_logprobs[mask]).max() <= 1e-4


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_a_first_call_is_what_the_engine_samples_for_the_same_seed(engine, greedy):
  responses, question = [], [{"role": "user", "content": "9="}]  # the taught model is unsure here: samples differ

  def agent(client, record):
    responses.append(
        client.chat.completions.create(model="m", messages=question, n=3, seed=5, max_tokens=10, logprobs=True,
                                       temperature=0 if greedy else TEMP).model_dump())
    return 0.0

  run(engine, task(agent), group=1, greedy=greedy)
  engine.greedy = greedy
  try:
    engine.submit([Request([TOK.bos_id] + TOK.encode("9="), n=3, max_tokens=10, key=jax.random.key(5))])
    direct = []
    while engine.pending:
      direct += engine.poll()
  finally:
    engine.greedy = False
  direct.sort(key=lambda s: s.index)
  for response in responses:
    assert [c["index"] for c in response["choices"]] == [0, 1, 2]
    for c, s in zip(response["choices"], direct):
      assert ids(response, c["index"]) == s.tokens.tolist()
      np.testing.assert_allclose([t["logprob"] for t in c["logprobs"]["content"]], s.logprobs, atol=1e-5)
      assert c["finish_reason"] == {"eos": "stop", "length": "length"}[s.finish_reason]
    assert response["usage"]["prompt_tokens"] == 3
    assert response["usage"]["completion_tokens"] == sum(len(s.tokens) for s in direct)
  if not greedy:
    assert len({tuple(s.tokens) for s in direct}) > 1  # the samples differ


def test_tool_calls_come_back_in_openais_shape_and_n_choices_continue_the_one_sent_back(engine):
  seen = {}

  def agent(client, record):
    q = EXAMPLE.question(record)
    assert [m.id for m in client.models.list()] == ["react"]
    first = client.chat.completions.create(model="m", messages=[{
        "role": "user",
        "content": q
    }], tools=EXAMPLE.TOOLS, n=2, temperature=0)
    choice = first.choices[1]  # the episode goes on with the second
    messages = [{"role": "user", "content": q}, choice.message]
    for call in choice.message.tool_calls or []:
      messages.append({
          "role": "tool",
          "tool_call_id": call.id,
          "content": calculator.calc(**json.loads(call.function.arguments))
      })
    if len(messages) == 2:
      messages.append({"role": "user", "content": "="})
    second = client.chat.completions.create(model="m", messages=messages, tools=EXAMPLE.TOOLS, n=2)  # a fork
    seen[record["a"]] = (first, second)
    return 1.0

  rollout, episodes, stream = run(engine, task(agent), group=1, greedy=True)
  assert stream.faults == 0 and (rollout.rewards == 1).all()
  for row, r in enumerate(RECORDS):
    first, second = seen[r["a"]]
    c = first.choices[1]
    assert first.choices[0].message.tool_calls[0].function == c.message.tool_calls[0].function  # greedy: alike
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,), product = c.message.tool_calls, str(r["a"] * r["b"])
    assert call.type == "function" and call.function.name == "calc"
    assert json.loads(call.function.arguments) == {"expression": f"{r['a']}*{r['b']}"}
    assert second.choices[0].message.content == product and second.choices[0].finish_reason == "stop"
    text = TOK.decode(rollout.completion[row][rollout.completion_valid[row]].tolist())
    assert text == f"<calc>{r['a']}*{r['b']}</calc>"  # the decode stops at the first turn's end-of-turn token
    assert rollout.turns[row] == 2  # the episode ended after the fork: its first choice is trained
  assert episodes[0].transcript[-1] == {"role": "model", "text": str(RECORDS[0]["a"] * RECORDS[0]["b"])}


def test_faulty_agents_end_only_their_own_episodes_and_are_counted(engine):
  """By record: an agent that raises, one that returns a string, one that rewrites its history, one
  that sleeps past its time; the group's other sample behaves and its episode is whole."""

  def agent(client, record):
    row = row_of(client)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "12*34="}])
    if row % 2:
      return 0.25
    if row == 0:
      raise RuntimeError("the agent broke")
    if row == 2:
      return "1.0"
    if row == 4:
      messages = [{"role": "user", "content": "12*35="}, reply.choices[0].message, {"role": "user", "content": "="}]
      with pytest.raises(openai.BadRequestError, match="does not continue the episode's conversation"):
        client.chat.completions.create(model="m", messages=messages)
      return 1.0
    time.sleep(60)  # past agent_timeout_s; its thread is left behind

  rollout, episodes, stream = run(engine, task(agent, agent_timeout_s=3.0))
  faults = [ep.fault for ep in episodes]
  assert "the agent raised RuntimeError: the agent broke" in faults[0]
  assert "the agent returned '1.0', not a number" in faults[2]
  assert "the agent rewrote its conversation" in faults[4]
  assert "AgentTask.agent_timeout_s" in faults[6]
  assert faults[1::2] == [None] * 4 and rollout.rewards[1::2].tolist() == [0.25] * 4
  assert rollout.rewards[0::2].tolist() == [0.0] * 4  # a fault scores 0, whatever the agent returned
  assert rollout.faults.tolist() == [1, 0] * 4 and stream.faults == 4
  # every episode once, each with the turn it took
  assert rollout.turns.tolist() == [1] * 8 and rollout.completion_mask[:, 0].all()


def test_turn_and_token_limits_truncate_the_episode_and_bad_parameters_are_refused(engine):
  refusals = {}

  def agent(client, record):
    messages, said = [{"role": "user", "content": EXAMPLE.question(record)}], refusals.setdefault(row_of(client), [])
    for bad in (dict(temperature=0.5), dict(stream=True), dict(n=99)):
      with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=messages, **bad)
      said.append(e.value.body["message"])
    while True:
      try:
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=3)
      except openai.BadRequestError as e:
        said.append(e.body["message"])
        return 0.5
      messages += [reply.choices[0].message, {"role": "user", "content": "0"}]

  rollout, episodes, stream = run(engine, task(agent, max_turns=4), group=1, turn_tokens=0)
  assert stream.faults == 0 and rollout.truncated.all() and (rollout.rewards == 0.5).all()
  assert rollout.turns.tolist() == [4] * 4
  assert sorted(refusals) == [0, 1, 2, 3]
  for said in refusals.values():  # the bad parameters did not end the episode; the fifth call did
    assert "rollout.temperature" in said[0] and "stream=true" in said[1] and "rollout.slots" in said[2]
    assert "over its turn limit: AgentTask.max_turns=4" in said[3] and len(said) == 4

  def long_agent(client, record):  # calls until the episode's 48 tokens are spent
    messages = [{"role": "user", "content": "1"}]
    while True:
      try:
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
      except openai.BadRequestError as e:
        return 0.0 if "over its token budget: rollout.max_new_tokens=48" in e.body["message"] else 9.0
      messages += [reply.choices[0].message, {"role": "user", "content": "*"}]

  rollout, _, stream = run(engine, task(long_agent, max_turns=99), group=1, turn_tokens=0)
  lengths = rollout.completion_valid.sum(1)
  assert stream.faults == 0 and rollout.truncated.all() and (rollout.rewards == 0).all() and (lengths <= 48).all()


def test_chunks_stream_through_advance_as_a_fleet_replica_streams_them(engine):
  """Two chunks submitted at different times to one stream: each comes back whole once its own
  episodes end, with its group ids, and the endpoint serves both at once."""
  stream = AgentStream(engine, task(lambda client, record: EXAMPLE.react(client, record) + 1.0))
  try:
    stream.submit("a", RECORDS[:2], 2, jax.random.key(0), [0, 1])
    finished = dict(stream.advance(max_s=0.0))  # one round: the agents have barely started
    stream.submit("b", RECORDS[2:], 1, jax.random.key(1), [2, 3])
    assert len(stream) == 2 - len(finished) and stream.rows == 6 - 4 * len(finished)
    while len(finished) < 2:
      finished.update(stream.advance(max_s=1.0, group_size=2))
  finally:
    stream.close()
  assert finished["a"].group_ids.tolist() == [0, 0, 1, 1] and finished["b"].group_ids.tolist() == [2, 3]
  assert all((r.rewards >= 1).all() and r.faults.sum() == 0 for r in finished.values())
  assert len(stream) == 0 and stream.rows == 0 and engine.held == 0
