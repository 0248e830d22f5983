"""Tasks: prompt/answer records, a reward, and the tokenizer that reads them.

A user task is a Python file with `make_task(config) -> Task`, named on the command line as
`--config.task=path/to/file.py:make_task`; built-in tasks are registered by name below.
"""
import dataclasses
import typing

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.specs import load_object


class TaskError(UserError):
  pass


@dataclasses.dataclass
class Task:
  """train / eval: sequences of dicts with at least 'prompt' and 'answer' (strings): lists, or
  views that read each record on demand (jaxrl_hex.data.files.Records), which the prompt stream
  reads by index.

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
    if self.tokenizer is None:  # one pass over the records, holding only the characters seen
      chars = set()
      for split in (self.train, self.eval):
        for r in split:
          chars.update(r["prompt"], r["answer"])
      self.tokenizer = CharTokenizer("".join(chars))


BUILTIN = {"arith": "jaxrl_hex.tasks.arithmetic:make_task", "files": "jaxrl_hex.tasks.files:make_task"}


def load_task(spec: str, config, check_prompts: bool = False) -> Task:
  """spec: a built-in name, 'module.path:fn', or 'path/to/file.py:fn'. check_prompts: every prompt
  the run will generate from fits config.rollout.max_prompt_len (check_prompt_lengths)."""
  spec = BUILTIN.get(spec, spec)
  if ":" not in spec:
    raise TaskError(f"task: {spec!r} is neither a built-in task {sorted(BUILTIN)} nor 'path/to/file.py:make_task'")
  task = load_object(spec, "task")(config)
  if not isinstance(task, Task):
    raise TaskError(f"task: {spec} returned {type(task).__name__}, not jaxrl_hex.tasks.Task")
  if check_prompts:
    check_prompt_lengths(task, config.rollout.max_prompt_len, max(config.train.eval_size, config.sft.eval_size))
  return task


def prompt_length(tokenizer, prompt) -> int:
  """Tokens the rollout engine holds for a prompt (rollout.engine.Engine.submit): BOS and the text's
  tokens, or the token ids as given."""
  return 1 + len(tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)


def check_prompt_lengths(task: Task, max_prompt_len: int, eval_size: int):
  """Every prompt the engine will see (the train split, the eval split's first eval_size) fits
  rollout.max_prompt_len. The engine refuses a longer one only when its batch comes up, which may be
  hours into a run, so all are measured as the task loads."""
  too_long, longest = [], 0
  for split, records in (("train", task.train), ("eval", task.eval[:eval_size])):
    over = 0  # counted as the records stream by: a file-backed split is never a list here
    for r in records:
      n = prompt_length(task.tokenizer, r["prompt"])
      if n > max_prompt_len:
        over, longest = over + 1, max(longest, n)
    if over:
      too_long.append(f"{over} of {len(records)} {split} prompts")
  if too_long:
    raise TaskError(f"rollout.max_prompt_len={max_prompt_len}: {' and '.join(too_long)} of task {task.name!r} are "
                    f"longer (up to {longest} tokens, BOS included); raise it, e.g. "
                    f"--config.rollout.max_prompt_len={longest} (the KV cache grows with it), or leave the long "
                    "records out of the task")
