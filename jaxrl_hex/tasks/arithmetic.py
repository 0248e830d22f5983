"""Multi-digit addition with an exact-match reward: '47+38=' -> '85'."""
import random

from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.tasks import Task


def exact_match(prompt: str, completion: str, answer: str) -> float:
  return float(completion.strip() == answer)


def make_task(config) -> Task:
  digits = config.task_args.get("digits", 2)
  n_eval = config.task_args.get("eval_size", 256)
  lo, hi = 10**(digits - 1), 10**digits - 1
  pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
  random.Random(1234).shuffle(pairs)  # fixed split: held-out pairs never appear in training
  records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
  return Task(name=f"arith{digits}", train=records[n_eval:], eval=records[:n_eval], reward=exact_match,
              tokenizer=CharTokenizer("0123456789+="))
