"""Tasks: prompt/answer records, a reward, and the tokenizer that reads them.

A user task is a Python file with `make_task(config) -> Task`, named on the command line as
`--config.task=path/to/file.py:make_task`; built-in tasks are registered by name below.
"""
import dataclasses
import importlib.util
import os
import typing

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.tokenizer import CharTokenizer


class TaskError(UserError):
  pass


@dataclasses.dataclass
class Task:
  """train / eval: sequences of dicts with at least 'prompt' and 'answer' (strings).

  reward(prompt, completion, answer) -> float, where 1.0 is a fully correct completion;
  eval accuracy is the mean reward of greedy completions on `eval`. tokenizer defaults to a
  character tokenizer over every character in the records.
  """
  name: str
  train: typing.Sequence[dict]
  eval: typing.Sequence[dict]
  reward: typing.Callable[[str, str, str], float]
  tokenizer: typing.Any = None

  def __post_init__(self):
    for split in ("train", "eval"):
      records = getattr(self, split)
      if not records:
        raise TaskError(f"task {self.name!r}: the {split} split is empty; give it records with 'prompt' and 'answer'")
      missing = [k for k in ("prompt", "answer") if k not in records[0]]
      if missing:
        raise TaskError(f"task {self.name!r}: {split} records lack {missing}; each record needs 'prompt' and 'answer'")
    if self.tokenizer is None:
      text = "".join(r["prompt"] + r["answer"] for split in (self.train, self.eval) for r in split)
      self.tokenizer = CharTokenizer(text)


BUILTIN = {"arith": "jaxrl_hex.tasks.arithmetic:make_task"}


def load_task(spec: str, config) -> Task:
  """spec: a built-in name, 'module.path:fn', or 'path/to/file.py:fn'."""
  spec = BUILTIN.get(spec, spec)
  if ":" not in spec:
    raise TaskError(f"task: {spec!r} is neither a built-in task {sorted(BUILTIN)} nor 'path/to/file.py:make_task'")
  where, fn_name = spec.rsplit(":", 1)
  if where.endswith(".py"):
    if not os.path.exists(where):
      raise TaskError(f"task: file {where!r} does not exist; pass --config.task=path/to/file.py:make_task")
    mod_spec = importlib.util.spec_from_file_location(f"user_task_{abs(hash(where))}", where)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
  else:
    try:
      module = importlib.import_module(where)
    except ModuleNotFoundError as e:
      raise TaskError(f"task: cannot import {where!r} ({e}); pass a built-in name or path/to/file.py:make_task") from None
  fn = getattr(module, fn_name, None)
  if fn is None:
    raise TaskError(f"task: {where!r} has no function {fn_name!r}; define make_task(config) -> jaxrl_hex.tasks.Task there")
  task = fn(config)
  if not isinstance(task, Task):
    raise TaskError(f"task: {spec} returned {type(task).__name__}, not jaxrl_hex.tasks.Task")
  return task
