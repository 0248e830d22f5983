"""Arithmetic questions in words for instruct models, asked through the model's chat template:
"What is 12 + 7?" with no instruction on how to answer. The reward is 1.0 when the completion's final
answer (its last number, as tasks/gsm8k.math_reward reads it) is the result.

One family, one built-in task per operation (tasks/__init__.py), both over the pairs of operands a, b
from 1 to task_args.max_operand: `arith_chat` asks their sum, `arith_chat_sub` takes the sum apart
again ("What is 19 - 7?" for a = 12, b = 7). `size` distinct questions, of which the first eval_size
are held out.
"""
import dataclasses
import operator
import random
import typing

from jaxrl_hex.tasks import Task, TaskError
from jaxrl_hex.tasks.gsm8k import hf_tokenizer, math_reward, prompt_formatter

ARGS = dict(max_operand=25, size=400, eval_size=96, chat_template=True, system_prompt="", eos_token="")


@dataclasses.dataclass(frozen=True)
class Operation:
  name: str
  question: str  # str.format over the operands a, b and their sum s
  answer: typing.Callable[[int, int], int]


ADDITION = Operation("arith_chat", "What is {a} + {b}?", operator.add)
SUBTRACTION = Operation("arith_chat_sub", "What is {s} - {b}?", lambda a, b: a)


def questions(op: Operation, max_operand: int, size: int) -> list[dict]:
  """`size` distinct questions {"question", "answer"} in a fixed shuffled order (the same every run)."""
  pairs = [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1)]
  if size > len(pairs):
    raise TaskError(f"{op.name}: task_args.size={size} is more than the {len(pairs)} distinct questions with operands "
                    f"up to task_args.max_operand={max_operand}; lower size or raise max_operand")
  random.Random(1234).shuffle(pairs)
  return [{"question": op.question.format(a=a, b=b, s=a + b), "answer": str(op.answer(a, b))} for a, b in pairs[:size]]


def make_task(config, op: Operation = ADDITION) -> Task:
  args = dict(ARGS, **config.task_args)
  if not config.get("model_dir"):
    raise TaskError(f"{op.name}: set --config.model_dir to an instruct model (a Hugging Face directory, a .gguf file, "
                    "or SmolLM2-135M-Instruct); its tokenizer and chat template ask the questions")
  if not 0 < args["eval_size"] < args["size"]:
    raise TaskError(f"{op.name}: task_args.eval_size={args['eval_size']} must be between 0 and task_args.size="
                    f"{args['size']} (the held-out questions come out of them)")
  tokenizer = hf_tokenizer(config)
  prompt = prompt_formatter(tokenizer, args, "Question: {prompt}\nAnswer:")
  records = [{
      "prompt": prompt(q["question"]),
      "answer": q["answer"]
  } for q in questions(op, args["max_operand"], args["size"])]
  n = args["eval_size"]
  return Task(name=op.name, train=records[n:], eval=records[:n], reward=math_reward, tokenizer=tokenizer)


def make_subtraction(config) -> Task:
  return make_task(config, SUBTRACTION)
