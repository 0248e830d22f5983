"""Agent tasks: episodes run by the user's own agent code, written against the `openai` client.

A user agent task is a Python file with `make_agent(config) -> AgentTask`, named on the command
line like a task (`--config.task=path/to/my_agent.py:make_agent`). Its `agent(client, record)`
runs one episode: any number of `client.chat.completions.create(...)` calls, its own tools and
parsing in between, and returns the episode's reward (a float). The rollout side
(jaxrl_hex/rollout/agents.py) gives each episode a client whose base URL is an OpenAI-compatible
endpoint in front of the rollout engine, and stitches the episode's calls into one token sequence:
the model's replies are trained, everything the agent sends is context.

This module holds what both sides of that need without the engine: the task, and how the agent's
chat messages become tokens (the same for the endpoint and for a demo's warm start).
"""
import dataclasses
import functools
import typing

from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.tasks.environment import Observation, render
from jaxrl_hex.tasks.task import TaskError
from jaxrl_hex.tasks.tools import Result, tool_format


@dataclasses.dataclass
class AgentTask:
  """train / eval: sequences of records (dicts) handed to the agent; agent(client, record) -> float:
  one episode against an `openai.OpenAI` client, its reward (1.0: solved); held-out success is the
  mean reward of greedy episodes on `eval`. tools: jaxrl_hex.tasks.tools.Tool (or plain functions)
  whose calls the endpoint parses out of the model's text into OpenAI `tool_calls` when a call
  passes `tools=` (the agent runs them itself), in `tool_format` ("tags" for character tokenizers,
  "hermes" for chat models). demo(record) -> the episode a supervised warm start teaches, as
  (observation, by_model) segments in order: first the first call's messages (or text), then the
  model's turns (True, each gets the end-of-turn token) and what the agent sends between them
  (False: text, or chat messages, tool results as {"role": "tool", "content"}). max_turns: calls
  per episode; agent_timeout_s: the agent's own time per episode (waiting on the model excluded).
  tokenizer: as for Task (default: characters of the records' string fields)."""
  name: str
  train: typing.Sequence[dict]
  eval: typing.Sequence[dict]
  agent: typing.Callable[[typing.Any, dict], float]
  tools: typing.Sequence = ()
  tool_format: str = "tags"
  tokenizer: typing.Any = None
  demo: typing.Callable[[dict], list] | None = None
  max_turns: int = 8
  agent_timeout_s: float = 120.0

  def __post_init__(self):
    for split in ("train", "eval"):
      if not getattr(self, split):
        raise TaskError(f"agent task {self.name!r}: the {split} split is empty; give it records for the agent")
    if not callable(self.agent):
      raise TaskError(f"agent task {self.name!r}: agent={self.agent!r} is not callable; give a function "
                      "agent(client, record) -> reward")
    if self.max_turns < 1:
      raise TaskError(f"agent task {self.name!r}: max_turns={self.max_turns}; give at least 1")
    if not self.agent_timeout_s > 0:
      raise TaskError(f"agent task {self.name!r}: agent_timeout_s={self.agent_timeout_s}; give a positive number "
                      "of seconds")
    self.tools = list(tool_format(self.tool_format, self.tools).tools.values())  # one line for a bad format or tool
    if self.tokenizer is None:
      texts = [v for split in (self.train, self.eval) for r in split for v in r.values() if isinstance(v, str)]
      self.tokenizer = CharTokenizer("".join(sorted(set("".join(texts)))))
    if self.tool_format == "hermes" and getattr(self.tokenizer, "chat_template", None) is None:
      raise TaskError(f"agent task {self.name!r}: tool_format='hermes' writes tool results as chat messages, but the "
                      "tokenizer has no chat template; use tool_format='tags' or a chat model's tokenizer")

  @functools.cached_property
  def call_format(self):
    """The tool format that parses the model's calls of this task's tools."""
    return tool_format(self.tool_format, self.tools)

  def schemas(self, tools=None) -> list:
    """The function schemas a chat template lists in the first prompt (hermes only): `tools` as a call
    passes them (OpenAI's shape), else the task's own."""
    if self.tool_format != "hermes":
      return []
    return list(tools) if tools is not None else [t.schema() for t in self.tools]


def content_text(content) -> str:
  """A chat message's content (a string, None, or a list of text parts) -> its text."""
  if content is None or isinstance(content, str):
    return content or ""
  if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
    return "".join(str(p.get("text", "")) for p in content)
  raise TaskError(f"a message's content {content!r:.80} is neither text nor a list of text parts; only text is served")


def observation(task: AgentTask, messages: list, tool_names: dict | None = None) -> Observation:
  """Chat messages the model reads (a first call's, or those after its reply) -> the observation
  environment.render takes. Tool messages become the tool format's observation of their results
  (consecutive ones together, as one turn's results), named by tool_names {tool_call_id: name}.
  Without a chat template that is text: the messages' contents in order (with the tags format,
  rendering is concatenation); with one, chat messages (a tags observation as a user message)."""
  tool_names, fmt = tool_names or {}, task.call_format
  chat = getattr(task.tokenizer, "chat_template", None) is not None
  out, results = [], []

  def flush():
    if results:
      obs = fmt.observation(results)
      out.extend(obs if isinstance(obs, list) else [{"role": "user", "content": obs}])
      results.clear()

  for m in messages:
    role, text = m.get("role"), content_text(m.get("content"))
    if role == "tool":
      results.append(Result(tool_names.get(m.get("tool_call_id"), m.get("name") or ""), text))
      continue
    flush()
    if role not in ("system", "developer", "user", "assistant"):
      raise TaskError(f"a message's role {role!r} is not one of system, developer, user, assistant, tool")
    if m.get("tool_calls") and not chat:
      raise TaskError("an assistant message with tool_calls that is not the model's reply: without a chat template "
                      "only the model's own replies carry calls; send the call as the message's text")
    message = {"role": "system" if role == "developer" else role, "content": text}
    if m.get("tool_calls"):
      message["tool_calls"] = m["tool_calls"]
    out.append(message)
  flush()
  return out if chat else "".join(m["content"] for m in out)


def prompt_tokens(task: AgentTask, first, tools=None) -> list[int]:
  """The token ids (BOS first) of an episode's first prompt: a first call's messages (or text) and
  the `tools` it passes."""
  tok = task.tokenizer
  return [tok.bos_id] + render(tok, _as_observation(task, first), True, task.schemas(tools))


def context_tokens(task: AgentTask, messages, tool_names: dict | None = None) -> list[int]:
  """The token ids of what the agent sends after the model's reply (messages, or text)."""
  return render(task.tokenizer, _as_observation(task, messages, tool_names), False)


def _as_observation(task, messages, tool_names=None) -> Observation:
  return messages if isinstance(messages, str) else observation(task, messages, tool_names)


def agent_prompt(task: AgentTask, record: dict) -> list[int]:
  """A record's first prompt as far as it is known before the agent runs: its demo's first call
  (prompt lengths, the weight-sync probe); BOS alone for a task without a demo."""
  if task.demo is None:
    return [task.tokenizer.bos_id]
  return agent_demo(task, record)[0]


def agent_demo(task: AgentTask, record: dict) -> tuple[list[int], list[int], list[bool]]:
  """A record's demonstration episode (AgentTask.demo) -> (first prompt ids, the tokens after it,
  which of them are the model's), rendered as the endpoint renders the agent's calls."""
  if task.demo is None:
    raise TaskError(f"agent task {task.name!r} has no demo(record); a supervised warm start needs the episodes to "
                    "imitate (AgentTask.demo), or start RL from a model (--config.init_from or model.model_dir)")
  segments = list(task.demo(record))
  if not segments or segments[0][1]:
    raise TaskError(f"agent task {task.name!r}: demo(record) must start with the first call's messages, "
                    "(messages, False), before the model's first turn")
  tok, tokens, by_model = task.tokenizer, [], []
  for obs, model in segments[1:]:
    ids = tok.encode(obs) + [tok.eos_id] if model else context_tokens(task, obs)
    tokens += ids
    by_model += [bool(model)] * len(ids)
  return prompt_tokens(task, segments[0][0]), tokens, by_model
