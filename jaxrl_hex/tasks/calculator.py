"""A tool task: long multiplication, which the tiny model cannot do alone but can with a calculator.

  prompt        123*456=
  model         <calc>123*456</calc>        (a tool call, in the tag format)
  tool          <result>56088</result>
  model         56088                       reward 1 when it is the product

The warm start imitates such episodes until held-out success reaches sft.target_accuracy, so RL
starts from a policy that sometimes calls the tool and copies its result right.
"""
import random
import string

from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.tasks.environment import EnvTask, Step
from jaxrl_hex.tasks.tools import Result, tool, tool_format

# digits and the tags, plus what a tool's error observation may say (printable ASCII)
ALPHABET = "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")


@tool
def calc(expression: str) -> str:
  """Evaluates a product of whole numbers, e.g. 12*34."""
  factors = expression.split("*")
  if len(factors) < 2 or not all(f.strip().isdigit() for f in factors):
    raise ValueError("not a product")  # short: the error observation shares the episode's token budget
  out = 1
  for f in factors:
    out *= int(f)
  return str(out)


class Multiply:
  """An episode: the question, then any number of calculator calls, then one answer."""

  def reset(self, record):
    self.answer = str(record["a"] * record["b"])
    return f"{record['a']}*{record['b']}="

  def step(self, text):
    return Step(reward=float(text.strip() == self.answer), done=True)


def demo(record):
  product = str(record["a"] * record["b"])
  expression = f"{record['a']}*{record['b']}"
  return [(f"<calc>{expression}</calc>", True), (tool_format("tags").observation([Result("calc", product)]), False),
          (product, True)]


def make_env(config) -> EnvTask:
  digits = config.task_args.get("digits", 3)
  n_eval = config.task_args.get("eval_size", 256)
  lo, hi = 10**(digits - 1), 10**digits - 1
  rng = random.Random(1234)
  pairs = sorted({(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(20000)})
  rng.shuffle(pairs)  # fixed split: held-out pairs never appear in training
  records = [{"a": a, "b": b} for a, b in pairs]
  return EnvTask(name=f"calculator{digits}", train=records[n_eval:], eval=records[:n_eval], env=Multiply, tools=[calc],
                 tool_format="tags", max_turns=3, demo=demo, tokenizer=CharTokenizer(ALPHABET))
