"""The chat arithmetic family: fixed distinct questions per operation, the held-out split, prompts
through the model's chat template with no instruction, the final-number reward, one-line errors."""
import ml_collections
import pytest
from hf_support import save_tokenizer

from jaxrl_hex.config import base_config
from jaxrl_hex.tasks import TaskError, load_task
from jaxrl_hex.tasks.chat_arithmetic import ADDITION, ARGS, SUBTRACTION, questions


def test_each_operation_asks_distinct_questions_in_a_fixed_order():
  sums = questions(ADDITION, 25, 400)
  assert sums == questions(ADDITION, 25, 400) and len({q["question"] for q in sums}) == 400
  for q in sums:
    a, b = map(int, q["question"].removeprefix("What is ").removesuffix("?").split(" + "))
    assert max(a, b) <= 25 and min(a, b) >= 1 and q["answer"] == str(a + b)
  differences = questions(SUBTRACTION, 25, 400)
  for q, s in zip(differences, sums):  # the same pairs, the sums taken apart again
    total, b = map(int, q["question"].removeprefix("What is ").removesuffix("?").split(" - "))
    assert total == int(s["answer"]) and q["answer"] == str(total - b) and 1 <= total - b <= 25
  with pytest.raises(TaskError, match="arith_chat: task_args.size=700 is more than the 625 distinct questions"):
    questions(ADDITION, 25, 700)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("chat")
  save_tokenizer(str(path), [f"What is {a} + {b}? {a + b}" for a in range(30) for b in range(30)])
  return str(path)


def _config(model_dir, task, **task_args):
  cfg = base_config()
  cfg.task, cfg.model_dir = task, model_dir
  cfg.task_args = ml_collections.ConfigDict(dict(ARGS, **task_args))
  return cfg


@pytest.mark.parametrize("name", ["arith_chat", "arith_chat_sub"])
def test_the_built_in_tasks_ask_through_the_chat_template_and_hold_out_eval_size(model_dir, name):
  task = load_task(name, _config(model_dir, name))
  assert task.name == name and (len(task.train), len(task.eval)) == (304, 96)
  first = task.eval[0]
  sign = "+" if name == "arith_chat" else "-"
  assert first["prompt"].startswith("<|im_start|>user\nWhat is ") and f" {sign} " in first["prompt"]
  assert first["prompt"].endswith("?<|im_end|>\n<|im_start|>assistant\n")  # the question alone, no instruction
  held_out = {r["prompt"] for r in task.eval}
  assert not held_out & {r["prompt"] for r in task.train}


def test_the_reward_reads_the_completions_final_number(model_dir):
  reward = load_task("arith_chat", _config(model_dir, "arith_chat")).reward
  assert reward("", "12 + 7 = 19.", "19") == 1.0 and reward("", "The answer is 19", "19") == 1.0
  assert reward("", "19 - 7 = 11.", "12") == 0.0  # a restated operand is not the answer
  assert reward("", "Let me think about it", "12") == 0.0


def test_bad_task_args_fail_in_one_line(model_dir):
  with pytest.raises(TaskError) as e:
    load_task("arith_chat", _config("", "arith_chat"))
  assert str(e.value) == ("arith_chat: set --config.model_dir to an instruct model (a Hugging Face directory, a .gguf "
                          "file, or SmolLM2-135M-Instruct); its tokenizer and chat template ask the questions")
  with pytest.raises(TaskError, match=r"task_args.eval_size=400 must be between 0 and task_args.size=400"):
    load_task("arith_chat_sub", _config(model_dir, "arith_chat_sub", eval_size=400))
