"""Environments: multi-turn tasks where the model acts, tools answer and the environment replies.

A user environment is a Python file with `make_env(config) -> EnvTask`, named on the command line
like a task: `--config.task=path/to/my_env.py:make_env`. Each episode gets a fresh `Env` from
`EnvTask.env()`; the rollout side (jaxrl_hex/rollout/episodes.py) runs it:

  observation = env.reset(record)            # the first prompt: text, or chat messages
  loop:  the model takes a turn (ends with its end-of-turn token)
         the turn calls tools   -> the tools' results are the next observation
         else step = env.step(turn text)     # Step(observation, reward, done)
  until done, EnvTask.max_turns model turns, or the episode's token budget (rollout.max_new_tokens)

The episode is one token sequence: the model's turns are trained (behaviour logprobs, versions);
observations and tool results are context only. Its reward is the sum of its steps' rewards, and
held-out success is the mean reward of greedy episodes on `eval` (1.0: solved).
"""
import dataclasses
import typing

from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.tasks.task import TaskError
from jaxrl_hex.tasks.tools import as_tools, tool_format

Observation = str | list  # text, or chat messages [{"role", "content"}]


@dataclasses.dataclass
class Step:
  """What the environment answers to a model turn that calls no tool."""
  observation: Observation | None = None  # the next observation; None when done
  reward: float = 0.0  # this step's contribution to the episode's reward
  done: bool = False


class Env:
  """One episode's environment. Subclass it, or give any object with these two methods."""

  def reset(self, record: dict) -> Observation:
    """The episode's first observation (its prompt) for a record of the task's split."""
    raise NotImplementedError

  def step(self, text: str) -> Step:
    """The environment's answer to the model's turn `text` (its end-of-turn token stripped)."""
    raise NotImplementedError


@dataclasses.dataclass
class EnvTask:
  """train / eval: sequences of records (dicts) that Env.reset reads; env: makes one Env per
  episode; tools: jaxrl_hex.tasks.tools.Tool (or plain functions) the model may call, in
  `tool_format` ("tags": <name>args</name>, for character tokenizers; "hermes": <tool_call> JSON,
  for chat models such as Qwen); max_turns: model turns per episode. demo(record) -> the episode a
  supervised warm start teaches, as (text, by_model) segments in order: the model's turns (True,
  each gets the end-of-turn token) and the observations (False, context only). tokenizer: as for
  Task (default: characters of the records' 'prompt' and 'answer' fields, if any)."""
  name: str
  train: typing.Sequence[dict]
  eval: typing.Sequence[dict]
  env: typing.Callable[[], typing.Any]
  tools: typing.Sequence = ()
  tool_format: str = "tags"
  max_turns: int = 8
  demo: typing.Callable[[dict], list] | None = None
  tokenizer: typing.Any = None
  tool_timeout_s: float = 10.0
  env_timeout_s: float = 60.0

  def __post_init__(self):
    for split in ("train", "eval"):
      if not getattr(self, split):
        raise TaskError(f"environment {self.name!r}: the {split} split is empty; give it records for Env.reset")
    if not callable(self.env):
      raise TaskError(f"environment {self.name!r}: env={self.env!r} is not callable; give a class or function "
                      "that makes one Env per episode")
    if self.max_turns < 1:
      raise TaskError(f"environment {self.name!r}: max_turns={self.max_turns}; give at least 1")
    tool_format(self.tool_format)  # refuses an unknown format in one line
    self.tools = list(as_tools(self.tools).values())
    if self.tokenizer is None:
      chars = set()
      for split in (self.train, self.eval):
        for r in split:
          for v in r.values():
            chars.update(v if isinstance(v, str) else "")
      self.tokenizer = CharTokenizer("".join(sorted(chars)))

  def listed_tools(self) -> list:
    """The tools' schemas a chat template lists in the first prompt (hermes); the tag format's
    tasks teach their tools by demonstration instead."""
    return [t.schema() for t in self.tools] if self.tool_format == "hermes" else []


def render(tokenizer, observation, first: bool, tools=()) -> list[int]:
  """An observation's token ids. Text is encoded as it is (a character tokenizer's format is the
  task's own). With a chat template, text is a user message, and messages after the model's turn
  are rendered as the template continues a conversation: the first prompt as the template opens
  it (generation prompt included, `tools` schemas listed where the template lists them), later
  ones from just after the model's end-of-turn token."""
  template = getattr(tokenizer, "chat_template", None)
  if template is None:
    if not isinstance(observation, str):
      raise TaskError(f"an observation of type {type(observation).__name__}: this tokenizer has no chat template, "
                      "so observations must be text")
    return tokenizer.encode(observation)
  messages = [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
  if first:
    return tokenizer.encode(tokenizer.prompt_messages(messages, tools=tools))
  # what the template writes after an assistant turn's end-of-turn token, then the new messages
  base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
  before = tokenizer.apply_chat_template(base, add_generation_prompt=False)
  after = tokenizer.apply_chat_template(base + messages, add_generation_prompt=True)
  if not after.startswith(before):
    raise TaskError("the chat template renders a conversation's start differently once messages follow; "
                    "observations cannot continue it")
  eot = tokenizer.token_text(tokenizer.eos_id)
  tail = before[before.rindex(eot) + len(eot):] if eot and eot in before else ""
  return tokenizer.encode(tail + after[len(before):])


def first_prompt(task: EnvTask, record: dict) -> list[int]:
  """The token ids (BOS first) of a fresh episode's first observation of `record`."""
  tok = task.tokenizer
  return [tok.bos_id] + render(tok, task.env().reset(record), True, task.listed_tools())


def demo_tokens(task: EnvTask, record: dict) -> tuple[list[int], list[int], list[bool]]:
  """A record's demonstration episode (EnvTask.demo) -> (first prompt ids, the tokens after it,
  which of them are the model's: its turns, each closed by the end-of-turn token)."""
  if task.demo is None:
    raise TaskError(f"environment {task.name!r} has no demo(record); a supervised warm start needs the episodes "
                    "to imitate (EnvTask.demo), or start RL from a model (--config.init_from or model.model_dir)")
  tok, tokens, by_model = task.tokenizer, [], []
  for text, model in task.demo(record):
    ids = tok.encode(text) + [tok.eos_id] if model else render(tok, text, False)
    tokens += ids
    by_model += [bool(model)] * len(ids)
  return first_prompt(task, record), tokens, by_model
