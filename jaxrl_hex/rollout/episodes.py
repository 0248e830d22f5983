"""Episodes of an environment through one running engine: multi-turn rollouts with tools.

An episode starts from its environment's first observation (Env.reset) and alternates the
model's turns with observations: the engine samples a turn until the model's end-of-turn token,
then the turn goes to a worker thread, which runs the tools it calls (isolated processes, with a
timeout) or asks the environment for its answer (Env.step), and the reply's tokens continue the
episode's sequence in the engine (Engine.extend: a held sequence keeps its KV, so a turn
prefills only the new tokens). The engine never waits on an environment: while one episode's tool
runs, the others' turns decode in its slots.

Each episode is one row of a Rollout: the tokens after its first prompt, the model's (trained,
with behaviour logprobs and versions) and the observations' (context only). Its reward is the sum
of its steps' rewards. A group of G episodes shares a record; their first prompt is prefilled
once. A fault inside one episode (an environment that raises, hangs or answers the wrong type, a
reply over the token budget) ends that episode where it is, is counted, and the run goes on.

EpisodeStream has ChunkStream's interface (submit, advance, rows), so a fleet replica streams
chunks of episodes as it streams chunks of prompt groups.
"""
import concurrent.futures
import dataclasses
import logging
import math
import time
import typing

import jax
import numpy as np

from jaxrl_hex.data.rollouts import Rollout, bucket
from jaxrl_hex.rollout.engine import Request
from jaxrl_hex.tasks.environment import Step, render
from jaxrl_hex.tasks.tools import ToolRunner, tool_format

_WAIT_S = 0.05  # longest an idle engine waits for an environment before it looks for news
_WARNED = set()  # tasks whose first episode fault was logged


class EpisodeFault(Exception):
  """Ends one episode (counted, reported); never the run."""


@dataclasses.dataclass
class Episode:
  """One episode's sequence so far. tokens: everything after the first prompt; by_model: which
  of them the model sampled (the loss mask)."""
  chunk: typing.Any
  row: int
  env: typing.Any
  prompt: list
  tokens: list = dataclasses.field(default_factory=list)
  by_model: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  reward: float = 0.0
  turns: int = 0
  tool_calls: int = 0
  tool_errors: int = 0
  fault: str | None = None
  truncated: bool = False
  done: bool = False
  session: typing.Any = None  # the engine's held sequence between turns
  transcript: list = dataclasses.field(default_factory=list)  # [{"role": "model" | "tool" | "env", "text"}]

  def add(self, tokens, by_model: bool, logprobs=None, versions=None):
    n = len(tokens)
    self.tokens += list(tokens)
    self.by_model += [by_model] * n
    self.logprobs += list(logprobs) if logprobs is not None else [0.0] * n
    self.versions += list(versions) if versions is not None else [-1] * n


class _Reply(typing.NamedTuple):
  """A worker thread's answer to a model turn."""
  observation: typing.Any  # text or messages; None: the episode ends
  reward: float
  done: bool
  calls: int = 0
  errors: int = 0
  role: str = "env"


@dataclasses.dataclass
class _Chunk:
  episodes: list
  group_size: int
  group_ids: np.ndarray


class EpisodeStream:
  """submit(key, records, group_size, rng, group_ids) starts a chunk's episodes (group_size per
  record); advance() runs the engine and the environments and returns [(key, Rollout)] of the
  chunks whose episodes all ended. Keep the engine's tokens per turn below its max_new_tokens
  (the episode's whole budget) with turn_tokens (0: no cap per turn)."""

  def __init__(self, engine, task, turn_tokens: int = 0, workers: int = 8):
    self.engine, self.task = engine, task
    self.turn_tokens = int(turn_tokens)
    self.format = tool_format(task.tool_format, task.tools)
    self.tools = ToolRunner(task.tools, task.tool_timeout_s) if task.tools else None
    self._schemas = task.listed_tools()
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="episode")
    self._chunks = {}  # key -> _Chunk, in submission order
    self._waiting = {}  # future -> (episode, started): turns with a tool or the environment, in turn order
    # an engine whose pool spans processes runs each program in all of them at once, so every process
    # must extend the same episodes at the same step: it waits for each hand-back's replies and takes
    # them in turn order, never by which thread finished first
    self.lockstep = jax.process_count() > 1
    self.faults = 0

  # ---- the chunk interface (rollout.stream.ChunkStream's) ---------------------------------------
  def submit(self, key, records: list, group_size: int, rng, group_ids=None):
    if key in self._chunks:
      raise ValueError(f"chunk {key!r} is already in the stream")
    group_ids = np.arange(len(records)) if group_ids is None else np.asarray(group_ids)
    chunk = _Chunk([], group_size, group_ids)
    self._chunks[key] = chunk
    for i, (record, gid) in enumerate(zip(records, group_ids)):
      group = [Episode(key, i * group_size + j, self.task.env(), []) for j in range(group_size)]
      chunk.episodes += group
      prompts = [self._reset(ep, record) for ep in group]
      live = [(ep, p) for ep, p in zip(group, prompts) if p is not None]
      # one request for the group when its first prompts agree: one prefill for all, sample j keyed fold_in(key, j)
      gkey = jax.random.fold_in(rng, int(gid))
      if len(live) == group_size and all(p == prompts[0] for p in prompts):
        self.engine.submit([self._request(prompts[0], (key, i * group_size, None), gkey, n=group_size)])
      else:
        for ep, p in live:
          self.engine.submit([self._request(p, (key, ep.row, None), jax.random.fold_in(gkey, ep.row), n=1)])

  @property
  def rows(self) -> int:
    """Episodes not yet ended."""
    return sum(not ep.done for c in self._chunks.values() for ep in c.episodes)

  def __len__(self) -> int:
    return len(self._chunks)

  def advance(self, max_s: float = 0.0, group_size: int = 1, arrived=lambda: False) -> list:
    """Runs the engine's hand-backs and the environments' replies -> [(key, Rollout)] of the
    chunks that finished. Returns after one round, or with max_s > 0 once a chunk finishes, the
    engine has room for a group of `group_size` it does not have, `arrived()`, or max_s passed."""
    t0, done = time.perf_counter(), []
    engine = self.engine
    while self._chunks:
      self._take_replies()
      if engine.queued or engine.free_slots < engine.num_slots:
        for sample in engine.poll():
          self._on_turn(sample)
        if self.lockstep:
          concurrent.futures.wait(list(self._waiting), timeout=self.task.env_timeout_s)
      elif self._waiting:  # every episode is with its environment: wait for one
        concurrent.futures.wait(list(self._waiting), timeout=min(_WAIT_S, max(max_s - (time.perf_counter() - t0), 0.0)),
                                return_when=concurrent.futures.FIRST_COMPLETED)
        self._take_replies()
      done = [k for k, c in self._chunks.items() if all(ep.done for ep in c.episodes)]
      hungry = not engine.queued and engine.free_slots >= group_size and not self._waiting
      if done or hungry or arrived() or time.perf_counter() - t0 >= max_s:
        break
    return [(k, self._assemble(self._chunks.pop(k))) for k in done]

  def run(self, records: list, group_size: int, rng, group_ids=None) -> tuple:
    """A whole chunk on an otherwise idle stream -> (Rollout, its Episodes in row order)."""
    self.submit("run", records, group_size, rng, group_ids)
    episodes = self._chunks["run"].episodes
    while True:
      finished = self.advance(max_s=1.0, group_size=self.engine.num_slots + 1)
      if finished:
        return finished[0][1], episodes

  def _assemble(self, chunk: _Chunk) -> Rollout:
    return assemble(chunk.episodes, chunk.group_ids, chunk.group_size, self.engine.max_new_tokens,
                    self.engine.tokenizer.pad_id)

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)
    if self.tools is not None:
      self.tools.close()

  # ---- one episode ----------------------------------------------------------------------------
  def _request(self, prompt, rid, key, n=1) -> Request:
    return Request(prompt, n=n, max_tokens=self._turn_budget(0), id=rid, key=key, hold=True)

  def _turn_budget(self, used: int) -> int:
    left = self.engine.max_new_tokens - used
    return min(left, self.turn_tokens) if self.turn_tokens else left

  def _reset(self, ep, record):
    """The episode's first prompt (BOS first), or None when the environment failed to start."""
    try:
      observation = ep.env.reset(record)
      ep.prompt = [self.engine.tokenizer.bos_id] + render(self.engine.tokenizer, observation, True, self._schemas)
    except Exception as e:  # noqa: BLE001 -- a user's environment: any failure is this episode's
      self._end(ep, f"Env.reset raised {type(e).__name__}: {e}")
      return None
    ep.transcript.append({"role": "env", "text": _text(observation)})
    if len(ep.prompt) > self.engine.max_prompt_len:
      self._end(
          ep, f"its first observation is {len(ep.prompt)} tokens, over rollout.max_prompt_len="
          f"{self.engine.max_prompt_len}")
      return None
    return ep.prompt

  def _episode(self, sample) -> Episode:
    key, row, first = sample.request_id
    chunk = self._chunks[key]
    return chunk.episodes[row + (sample.index if first is None else 0)]

  def _on_turn(self, sample):
    """A model turn finished: record it, then hand it to a worker (tools or the environment)."""
    ep = self._episode(sample)
    ep.session = sample.session
    ep.add(sample.tokens, True, sample.logprobs, sample.versions)
    ep.turns += 1
    text = sample.text
    ep.transcript.append({"role": "model", "text": text})
    if len(ep.tokens) >= self.engine.max_new_tokens and sample.finish_reason == "length":
      ep.truncated = True
      self._end(ep, f"it reached the episode's token budget (rollout.max_new_tokens={self.engine.max_new_tokens})")
      return
    self._waiting[self._pool.submit(self._react, ep, text)] = (ep, time.monotonic())

  def _react(self, ep, text) -> _Reply:
    """In a worker thread: the tools the turn calls, else the environment's step."""
    calls = self.format.parse(text) if self.tools is not None else []
    if calls:
      results = self.tools.run(calls)
      errors = sum(r.error is not None for r in results)
      return _Reply(self.format.observation(results), 0.0, False, len(calls), errors, role="tool")
    step = ep.env.step(text)
    if isinstance(step, tuple) and len(step) == 3:
      step = Step(*step)
    if not isinstance(step, Step):
      raise EpisodeFault(f"Env.step returned {type(step).__name__}, not a Step(observation, reward, done)")
    try:
      reward = float(step.reward)
    except (TypeError, ValueError):
      raise EpisodeFault(f"Env.step's reward {step.reward!r} is not a number") from None
    if not math.isfinite(reward):
      raise EpisodeFault(f"Env.step's reward is {reward}, not finite")
    if not step.done and step.observation is None:
      raise EpisodeFault("Env.step returned no observation for an episode that is not done")
    return _Reply(step.observation, reward, bool(step.done))

  def _take_replies(self):
    now = time.monotonic()
    for future, (ep, started) in list(self._waiting.items()):
      if not future.done():
        # a hung environment (in lockstep: past the wait for its hand-back): its thread is left behind
        if self.lockstep or now - started > self.task.env_timeout_s:
          del self._waiting[future]
          self._end(ep, f"Env.step did not answer in {self.task.env_timeout_s}s (EnvTask.env_timeout_s)")
        continue
      del self._waiting[future]
      try:
        reply = future.result()
      except EpisodeFault as e:
        self._end(ep, str(e))
        continue
      except Exception as e:  # noqa: BLE001 -- a user's environment
        self._end(ep, f"Env.step raised {type(e).__name__}: {e}")
        continue
      self._continue(ep, reply)

  def _continue(self, ep, reply: _Reply):
    ep.reward += reply.reward
    ep.tool_calls += reply.calls
    ep.tool_errors += reply.errors
    if reply.done or reply.observation is None or ep.turns >= self.task.max_turns:
      self._end(ep)
      return
    try:
      tokens = render(self.engine.tokenizer, reply.observation, False)
    except Exception as e:  # noqa: BLE001 -- what the environment or a tool answered
      self._end(ep, f"its observation could not be rendered: {e}")
      return
    ep.transcript.append({"role": reply.role, "text": _text(reply.observation)})
    budget = self._turn_budget(len(ep.tokens) + len(tokens))
    if budget < 1:
      ep.truncated = True
      self._end(
          ep, f"an observation of {len(tokens)} tokens leaves no room in the episode's token budget "
          f"(rollout.max_new_tokens={self.engine.max_new_tokens})")
      return
    ep.add(tokens, False)
    self.engine.extend(ep.session, tokens, max_tokens=budget, id=(ep.chunk, ep.row, ep.row))

  def _end(self, ep, fault: str | None = None):
    if ep.session is not None:
      self.engine.drop(ep.session)
      ep.session = None
    ep.done = True
    if fault is not None:
      ep.fault = fault
      self.faults += 1
      if self.task.name not in _WARNED:  # once per task and process: the counts go to the metrics
        _WARNED.add(self.task.name)
        logging.warning("environment %r: an episode ended on a fault (counted as episode_faults): %s", self.task.name,
                        fault)


def assemble(episodes: list, group_ids, group_size: int, width: int, pad_id: int) -> Rollout:
  """Episodes (prompt-major: group g's are rows g * group_size ...) as a Rollout in the trainer's
  layout; width: the completion's columns (the engine's max_new_tokens, an episode's budget)."""
  n = len(episodes)
  p_len = bucket(max(len(ep.prompt) for ep in episodes) or 1)
  prompt_tokens, prompt_valid = np.full((n, p_len), pad_id, np.int32), np.zeros((n, p_len), bool)
  completion, by_model = np.full((n, width), pad_id, np.int32), np.zeros((n, width), bool)
  context, logprobs = np.zeros((n, width), bool), np.zeros((n, width), np.float32)
  versions = np.full((n, width), -1, np.int32)
  for i, ep in enumerate(episodes):
    k, m = len(ep.prompt), len(ep.tokens)
    prompt_tokens[i, p_len - k:], prompt_valid[i, p_len - k:] = ep.prompt, True
    completion[i, :m], logprobs[i, :m], versions[i, :m] = ep.tokens, ep.logprobs, ep.versions
    by_model[i, :m] = ep.by_model
    context[i, :m] = ~np.asarray(ep.by_model, bool)
  count = lambda f: np.array([f(ep) for ep in episodes], np.int32)
  return Rollout(prompt_tokens, prompt_valid, completion, by_model, logprobs, versions,
                 np.repeat(np.asarray(group_ids), group_size), rewards=np.array([ep.reward for ep in episodes],
                                                                                np.float32),
                 truncated=np.array([ep.truncated for ep in episodes]), context_mask=context,
                 turns=count(lambda ep: ep.turns), tool_calls=count(lambda ep: ep.tool_calls),
                 tool_errors=count(lambda ep: ep.tool_errors), faults=count(lambda ep: ep.fault is not None))


def _text(observation) -> str:
  if isinstance(observation, str):
    return observation
  return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in observation)


def episode_stats(rollout: Rollout) -> dict:
  """Per-batch figures of a Rollout of episodes (empty for single-turn rollouts)."""
  if rollout.turns is None:
    return {}
  policy, context = int(rollout.completion_mask.sum()), int(rollout.context_mask.sum())
  lengths = rollout.completion_valid.sum(1)
  return {
      "episode_turns": float(rollout.turns.mean()),
      "episode_tool_calls": float(rollout.tool_calls.mean()),
      "tool_errors": int(rollout.tool_errors.sum()),
      "episode_faults": int(rollout.faults.sum()),
      "env_token_share": context / max(policy + context, 1),
      "episode_tokens_mean": float(lengths.mean()),
      "episode_tokens_p90": float(np.percentile(lengths, 90)),
      "episode_tokens_max": int(lengths.max()),
  }
