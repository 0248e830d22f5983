"""Environments: the EnvTask checks, observations as tokens with and without a chat template,
demonstration episodes, and the built-in environments played by their own demonstrations."""
import ml_collections
import numpy as np
import pytest
from hf_support import save_tokenizer
from support import load_config

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.tokenizer import CharTokenizer, HFTokenizer
from jaxrl_hex.rl.batch import sft_batch
from jaxrl_hex.tasks import TaskError, load_task
from jaxrl_hex.tasks.calculator import calc
from jaxrl_hex.tasks.environment import EnvTask, Step, demo_tokens, first_prompt, render
from jaxrl_hex.tasks.guess import binary_search


class Echo:

  def reset(self, record):
    return record["q"]

  def step(self, text):
    return Step(text, reward=1.0, done=True)


RECORDS = [{"q": "ab"}]


def test_env_task_checks_name_the_field_and_the_fix():
  with pytest.raises(TaskError, match="the eval split is empty"):
    EnvTask("e", RECORDS, [], Echo)
  with pytest.raises(TaskError, match="is not callable"):
    EnvTask("e", RECORDS, RECORDS, Echo())
  with pytest.raises(TaskError, match="max_turns=0"):
    EnvTask("e", RECORDS, RECORDS, Echo, max_turns=0)
  with pytest.raises(TaskError, match="tool_format"):
    EnvTask("e", RECORDS, RECORDS, Echo, tool_format="xml")
  with pytest.raises(TaskError, match="two tools are named 'calc'"):
    EnvTask("e", RECORDS, RECORDS, Echo, tools=[calc, calc])
  task = EnvTask("e", RECORDS, RECORDS, Echo)
  assert isinstance(task.tokenizer, CharTokenizer) and task.tokenizer.encode("ba") != []


def test_a_user_environment_file_loads_and_bad_ones_say_why(tmp_path):
  cfg = load_config()
  path = tmp_path / "my_env.py"
  path.write_text("from jaxrl_hex.tasks.environment import EnvTask, Step\n"
                  "class E:\n  def reset(self, r): return r['q']\n  def step(self, t): return Step(done=True)\n"
                  "def make_env(config):\n  return EnvTask('mine', [{'q': 'x'}], [{'q': 'y'}], E)\n"
                  "def make_nothing(config):\n  return 3\n")
  task = load_task(f"{path}:make_env", cfg)
  assert task.name == "mine" and first_prompt(task, {"q": "x"}) == [task.tokenizer.bos_id] + task.tokenizer.encode("x")
  with pytest.raises(UserError, match="has no function 'make_envv'"):
    load_task(f"{path}:make_envv", cfg)
  with pytest.raises(UserError, match="does not exist"):
    load_task(f"{tmp_path}/nope.py:make_env", cfg)
  with pytest.raises(TaskError, match="returned int, not jaxrl_hex.tasks.Task, EnvTask or AgentTask"):
    load_task(f"{path}:make_nothing", cfg)


def test_text_observations_without_a_chat_template_are_the_text_and_messages_are_refused():
  tok = CharTokenizer("ab")
  assert render(tok, "ab", True) == tok.encode("ab") == render(tok, "ab", False)
  with pytest.raises(TaskError, match="must be text"):
    render(tok, [{"role": "user", "content": "a"}], False)


def test_chat_observations_continue_the_conversation_as_the_template_writes_it(tmp_path):
  save_tokenizer(str(tmp_path), ["hello there", "the tool said 42", "guess a number"] * 20)
  tok = HFTokenizer(str(tmp_path))
  first = render(tok, "guess a number", True)
  assert tok.decode(first) == tok.decode(
      tok.encode("<|im_start|>user\nguess a number<|im_end|>\n"
                 "<|im_start|>assistant\n"))
  # the model ends its turn with <|im_end|>; the template's newline after it, then the new message
  later = render(tok, [{"role": "tool", "content": "42"}], False)
  text = tok._tok.decode(later, skip_special_tokens=False)
  assert text == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
  # the whole conversation tokenized at once is the same sequence
  reply = tok.encode("hello there") + [tok.eos_id]
  whole = tok.encode(
      tok.prompt_messages([{
          "role": "user",
          "content": "guess a number"
      }, {
          "role": "assistant",
          "content": "hello there"
      }, {
          "role": "tool",
          "content": "42"
      }]))
  assert first + reply + later == whole


def test_demonstrations_are_sequences_with_the_model_turns_marked():
  task = load_task("calculator", load_config(**{"task_args": ml_collections.ConfigDict({"digits": 3})}))
  record = task.train[0]
  prompt, tokens, by_model = demo_tokens(task, record)
  tok = task.tokenizer
  a, b = record["a"], record["b"]
  assert tok.decode(prompt[1:]) == f"{a}*{b}="
  call = tok.encode(f"<calc>{a}*{b}</calc>") + [tok.eos_id]
  answer = tok.encode(str(a * b)) + [tok.eos_id]
  assert tokens[:len(call)] == call and tokens[-len(answer):] == answer
  assert by_model == [True] * len(call) + [False] * (len(tokens) - len(call) - len(answer)) + [True] * len(answer)
  batch = sft_batch(tok, [record], task)
  p = batch.tokens.shape[1] - batch.loss_mask.shape[1]
  assert batch.loss_mask[0].sum() == len(call) + len(answer)
  np.testing.assert_array_equal(batch.tokens[0, p:p + len(tokens)], tokens)
  assert batch.valid[0, p:].sum() == len(tokens)


@pytest.mark.parametrize("name,args", [("calculator", {"digits": 3}), ("guess", {"top": 31})])
def test_each_built_in_environment_is_solved_by_its_demonstration(name, args):
  task = load_task(name, load_config(**{"task_args": ml_collections.ConfigDict(args)}))
  for record in list(task.eval)[:20]:
    env, reward, turns = task.env(), 0.0, 0
    env.reset(record)
    segments = task.demo(record)
    for text, by_model in segments:
      if by_model:
        turns += 1
        if not text.startswith("<calc>"):  # a tool call goes to the tool, not the environment
          step = env.step(text)
          reward += step.reward
    assert reward == 1.0 and turns <= task.max_turns


def test_binary_search_finds_every_number_within_the_guess_budget():
  task = load_task("guess", load_config(**{"task_args": ml_collections.ConfigDict({"top": 31})}))
  assert max(len(binary_search(t, 31)) for t in range(1, 32)) == 5 == task.max_turns - 1
  env = task.env()
  assert env.reset({"target": 20, "top": 31}) == "?1-31:"
  assert [env.step(g).observation for g in ("16", "24", "x", "40")] == ["+", "-", "?", "?"]
  assert env.step("20") == Step("=", 1.0, True)


def test_the_calculator_multiplies_and_refuses_what_is_not_a_product():
  assert calc.fn("123*456") == "56088"
  with pytest.raises(ValueError, match="not a product"):
    calc.fn("1+2")
