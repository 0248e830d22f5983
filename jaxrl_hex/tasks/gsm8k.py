"""GSM8K-style math word problems from JSONL lines {"question": ..., "answer": ...}, rewarded 1.0
when the completion's final answer equals the reference's.

The reference is what follows GSM8K's '####' (or a \\boxed{} / the last number). A completion's
answer is its last \\boxed{...}, else the number after its last '####', else its last number.
Both are normalised (commas, $, %, \\text{units}, \\frac, trailing zeros) and compared as exact
fractions, so "1,000", "1000.00" and "\\boxed{1000}" agree.

Prompts go through the model's chat template when it has one (task_args.chat_template).
"""
import json
import re
from fractions import Fraction

from jaxrl_hex.config import resolve_path
from jaxrl_hex.models.model_dir import resolve_model_dir
from jaxrl_hex.models.tokenizer import HFTokenizer
from jaxrl_hex.tasks import Task, TaskError

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?")


def boxed(text: str) -> str | None:
  """The contents of the last \\boxed{...} (nested braces allowed), or None."""
  start = text.rfind("\\boxed{")
  if start < 0:
    return None
  depth, i = 1, start + len("\\boxed{")
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None


def extract_answer(text: str) -> str | None:
  found = boxed(text)
  if found is not None:
    return found
  if "####" in text:
    text = text.rsplit("####", 1)[1]
  numbers = NUMBER.findall(text)
  return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
  s = re.sub(r"\\text\{[^{}]*\}|\\[,!;]|\\?\$|\\?%|,|\s", "", answer)
  s = re.sub(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s).rstrip(".")
  m = re.fullmatch(r"\(?(-?[\d.]+)\)?(?:/\(?(-?[\d.]+)\)?)?", s)
  if m:
    try:
      value = Fraction(m.group(1)) / Fraction(m.group(2) or 1)
      return str(value.numerator) if value.denominator == 1 else str(value)
    except (ValueError, ZeroDivisionError):
      pass
  return s.lower()


def math_reward(prompt: str, completion: str, answer: str) -> float:
  got = extract_answer(completion)
  return float(got is not None and normalize(got) == normalize(answer))


def read_jsonl(path: str) -> list[dict]:
  """[{"question", "answer"}] with answer reduced to its final value; errors name file and line."""
  try:
    with open(resolve_path(path)) as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise TaskError(f"gsm8k: cannot read {path!r} ({e.strerror}); pass a JSONL file of "
                    '{"question": ..., "answer": ...} lines') from None
  records = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      final = extract_answer(str(row["answer"]))
      question = row["question"]
    except (json.JSONDecodeError, KeyError, TypeError):
      raise TaskError(f"{path}:{n}: expected a JSON object with 'question' and 'answer'") from None
    if final is None:
      raise TaskError(f"{path}:{n}: the answer has no final number ('#### 42', \\boxed{{42}} or a last number)")
    records.append({"question": question, "answer": final})
  return records


def hf_tokenizer(config) -> HFTokenizer:
  """config.model_dir's tokenizer; task_args.eos_token ("" = its own) names the token that ends a completion."""
  return HFTokenizer(resolve_model_dir(config.model_dir), eos_token=config.task_args.get("eos_token") or None)


def prompt_formatter(tokenizer, args, plain: str):
  """-> format(text, system=None) -> prompt: a user turn of the model's chat template (when the
  tokenizer has one and task_args.chat_template is on; system defaults to task_args.system_prompt),
  else plain.format(prompt=text, system=system or ""). A model's tokenizer without a template is
  refused while task_args.chat_template is on, so a chat model is never prompted as plain text unasked."""
  chat = bool(args.get("chat_template", True))
  if chat and isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template is None:
    raise TaskError(f"task_args.chat_template: {tokenizer.dir} has no chat template; set "
                    "--config.task_args.chat_template=False (prompts then follow task_args.prompt_format) or give the "
                    "model one (chat_template in its tokenizer_config.json, or a chat_template.jinja beside it)")
  chat = chat and getattr(tokenizer, "chat_template", None) is not None
  default_system = args.get("system_prompt") or None

  def format_prompt(text: str, system: str | None = None) -> str:
    if chat:
      return tokenizer.prompt(text, system=system or default_system)
    return plain.format(prompt=text, system=system or default_system or "")

  return format_prompt


def make_task(config) -> Task:
  args = config.task_args
  if not args.get("train_file"):
    raise TaskError("gsm8k: set --config.task_args.train_file=path/to/train.jsonl "
                    '(lines of {"question": ..., "answer": ...})')
  if not config.get("model_dir"):
    raise TaskError("gsm8k: set --config.model_dir to a Hugging Face model directory; its tokenizer reads the task")
  tokenizer = hf_tokenizer(config)
  prompt = prompt_formatter(tokenizer, args, "Question: {prompt}\nAnswer:")

  def records(path):
    return [{"prompt": prompt(f"{r['question']}\n{INSTRUCTION}"), "answer": r["answer"]} for r in read_jsonl(path)]

  train = records(args.train_file)
  if args.get("eval_file"):
    evals = records(args.eval_file)
  else:  # hold out the first eval_size problems of the train file
    n = min(args.get("eval_size", 256), len(train) // 2)
    train, evals = train[n:], train[:n]
  return Task(name="gsm8k", train=train, eval=evals, reward=math_reward, tokenizer=tokenizer)
