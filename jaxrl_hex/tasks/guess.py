"""A multi-turn environment with feedback: find a hidden number from higher/lower answers.

  prompt   ?1-31:
  model    16            env  +     (the number is higher)
  model    24            env  -     (lower)
  model    20            env  =     reward 1: found within EnvTask.max_turns guesses

The warm start imitates binary search, the turn-optimal strategy, until held-out success reaches
sft.target_accuracy; RL then learns from the episodes' rewards alone.
"""
import random

from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.tasks.environment import EnvTask, Step


class Guess:
  """One game: `+` the number is higher, `-` lower, `?` the guess was not a number in range."""

  def reset(self, record):
    self.target, self.top = record["target"], record["top"]
    return f"?1-{self.top}:"

  def step(self, text):
    guess = text.strip()
    if not guess.isdigit() or not 1 <= int(guess) <= self.top:
      return Step("?")
    if int(guess) == self.target:
      return Step("=", reward=1.0, done=True)
    return Step("+" if self.target > int(guess) else "-")


def binary_search(target: int, top: int) -> list:
  """The guesses of binary search over [1, top]."""
  lo, hi, out = 1, top, []
  while True:
    mid = (lo + hi) // 2
    out.append(mid)
    if mid == target:
      return out
    lo, hi = (mid + 1, hi) if target > mid else (lo, mid - 1)


def demo(record):
  out = []
  for g in binary_search(record["target"], record["top"]):
    out += [(str(g), True), ("=" if g == record["target"] else "+" if record["target"] > g else "-", False)]
  return out[:-1]  # the episode ends at the find


def make_env(config) -> EnvTask:
  top = config.task_args.get("top", 31)
  turns = config.task_args.get("turns", top.bit_length() + 1)  # one guess more than binary search needs
  targets = list(range(1, top + 1))
  records = [{"target": t, "top": top} for t in targets]
  # every target is a game to win: train draws them at random, eval plays each once (greedy)
  random.Random(1234).shuffle(records)
  return EnvTask(name=f"guess{top}", train=records * 8, eval=records, env=Guess, max_turns=turns, demo=demo,
                 tokenizer=CharTokenizer("0123456789?-+=:"))
