"""Agent tasks (tasks/agent.py): their checks, and how an agent's chat messages become the tokens of
one episode: concatenated text for a character tokenizer (tool results in the tags format), the
chat template's own rendering of the whole conversation for a chat model (hermes)."""
import json
import os

import pytest
from support import ROOT
from tasks.test_tools import QWEN_TOOLS_TEMPLATE
from tokenizers import Tokenizer

from jaxrl_hex.models.tokenizer import CharTokenizer, HFTokenizer
from jaxrl_hex.specs import load_module
from jaxrl_hex.tasks import calculator, is_episodic
from jaxrl_hex.tasks.agent import AgentTask, agent_demo, agent_prompt, context_tokens, prompt_tokens
from jaxrl_hex.tasks.environment import EnvTask, demo_tokens
from jaxrl_hex.tasks.task import TaskError

EXAMPLE = load_module(os.path.join(ROOT, "examples", "react_calculator.py"), "example")
TOK = CharTokenizer("0123456789*=<>/calcresultoe")
RECORDS = [{"a": 12, "b": 34}, {"a": 56, "b": 78}]


def task(**kw) -> AgentTask:
  return AgentTask(**dict(
      dict(name="t", train=RECORDS, eval=RECORDS, agent=EXAMPLE.react, tools=[calculator.calc], tokenizer=TOK,
           demo=EXAMPLE.demo), **kw))


@pytest.mark.parametrize("kw, match", [
    (dict(train=[]), "agent task 't': the train split is empty"),
    (dict(agent=3), "agent=3 is not callable; give a function agent\\(client, record\\) -> reward"),
    (dict(tool_format="xml"), "tool_format='xml': expected one of"),
    (dict(max_turns=0), "max_turns=0; give at least 1"),
    (dict(agent_timeout_s=0), "agent_timeout_s=0; give a positive number"),
    (dict(tool_format="hermes"), "tool_format='hermes' writes tool results as chat messages, but the tokenizer"),
    (dict(tools=[calculator.calc, calculator.calc]), "two tools are named 'calc'"),
])
def test_bad_fields_are_refused_in_one_line(kw, match):
  with pytest.raises(TaskError, match=match):
    task(**kw)


def test_the_examples_demo_is_the_calculator_environments_episode_token_for_token():
  t = task()
  env = EnvTask("calc", RECORDS, RECORDS, calculator.Multiply, tools=[calculator.calc], demo=calculator.demo,
                tokenizer=TOK)
  assert is_episodic(t) and is_episodic(env)
  for r in RECORDS:
    assert agent_demo(t, r) == demo_tokens(env, r)
    assert agent_prompt(t, r) == agent_demo(t, r)[0]
  assert agent_prompt(task(demo=None), RECORDS[0]) == [TOK.bos_id]  # unknown before the agent runs
  with pytest.raises(TaskError, match="demo\\(record\\) must start with the first call's messages"):
    agent_demo(task(demo=calculator.demo), RECORDS[0])


def test_without_a_chat_template_messages_are_their_text_and_tool_results_the_tags_observation():
  t = task()
  first = [{"role": "system", "content": "1"}, {"role": "user", "content": [{"type": "text", "text": "2*3="}]}]
  assert prompt_tokens(t, first) == [TOK.bos_id] + TOK.encode("12*3=")
  after = [{
      "role": "tool",
      "tool_call_id": "a",
      "content": "6"
  }, {
      "role": "tool",
      "content": "7"
  }, {
      "role": "user",
      "content": "="
  }]
  assert context_tokens(t, after, {"a": "calc"}) == TOK.encode("<result>6</result><result>7</result>=")
  with pytest.raises(TaskError, match="only text is served"):
    context_tokens(t, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
  with pytest.raises(TaskError, match="role 'robot'"):
    context_tokens(t, [{"role": "robot", "content": "1"}])


def test_with_a_chat_template_the_episode_is_the_templates_rendering_of_the_whole_conversation(tmp_path):
  """Qwen's tool template: the first prompt lists the call's tools, the model's reply is its own
  tokens and end-of-turn token, and the tool results that follow continue the template's text."""
  from hf_support import save_tokenizer
  save_tokenizer(str(tmp_path), ["<tool_call> tool_response calc user assistant system"], vocab_size=400)
  config_file = tmp_path / "tokenizer_config.json"
  config_file.write_text(json.dumps(dict(json.loads(config_file.read_text()), chat_template=QWEN_TOOLS_TEMPLATE)))
  tok = HFTokenizer(str(tmp_path))
  t = task(tokenizer=tok, tool_format="hermes")
  tools = [calculator.calc.schema()]
  question = [{"role": "user", "content": "12*34+1?"}]
  reply = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>'
  results = [{"role": "tool", "tool_call_id": "call_0", "content": "408"}]
  tokens = prompt_tokens(t, question, tools)[1:] + tok.encode(reply) + [tok.eos_id] + context_tokens(
      t, results, {"call_0": "calc"})
  whole = tok.apply_chat_template(question + [{"role": "assistant", "content": reply}] + results, tools=tools)
  assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).decode(tokens, skip_special_tokens=False) == whole
  assert json.dumps(calculator.calc.schema()) in whole and whole.endswith(
      "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
