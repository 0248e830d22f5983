"""The single-turn task: prompt/answer records, a reward, and the tokenizer that reads them."""
import dataclasses
import typing

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.tokenizer import CharTokenizer


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
