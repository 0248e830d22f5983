"""Tools (tasks/tools.py): schemas from signatures, the tags and hermes call formats, and the
runner, whose calls run in real forked processes: a tool that raises, hangs, dies, or returns
something that is not text gives an error result, counted, and the runner goes on."""
import json
import os
import threading
import time
import typing

import pytest

from jaxrl_hex.tasks.task import TaskError
from jaxrl_hex.tasks.tools import Call, Result, Tool, ToolRunner, as_tools, tool, tool_format


@tool
def add(a: int, b: float = 1.5, exact: bool = False, note: str | None = None) -> float:
  """Adds two numbers.

  Args:
    a: the first number.
    b (float): the second,
      a float.
  """
  return a + b


@tool(name="calc", description="Evaluates + and * of whole numbers.")
def calculator(expression: str) -> str:
  return str(eval(expression, {"__builtins__": {}}))  # the test's own expressions


@tool
def square(n: int) -> int:
  return n * n


def echo(text):
  return text


def misbehave(how: str):
  if how == "raise":
    raise ValueError("no such thing")
  if how == "hang":
    time.sleep(3600)
  if how == "die":
    os._exit(7)
  if how == "exit":
    raise SystemExit(3)
  if how == "print":
    print("garbage \x00\x07", flush=True)
    return "printed"
  return {
      "none": None,
      "bytes": b"abc",
      "huge": "x" * 100_000,
      "control": "ok\x00",
      "object": object(),
      "number": 2.5,
      "list": [1, "two", None],
      "set": {"not", "json"}
  }[how]


def pid():
  return os.getpid()


def wait_for(path: str) -> str:
  open(path + ".started", "w").close()
  while not os.path.exists(path):
    time.sleep(0.01)
  return "released"


def test_schema_from_a_typed_function():
  assert add.schema() == {
      "type": "function",
      "function": {
          "name": "add",
          "description": "Adds two numbers.",
          "parameters": {
              "type": "object",
              "properties": {
                  "a": {
                      "type": "integer",
                      "description": "the first number."
                  },
                  "b": {
                      "type": "number",
                      "description": "the second, a float."
                  },
                  "exact": {
                      "type": "boolean"
                  },
                  "note": {
                      "type": "string"
                  }
              },
              "required": ["a"]
          }
      }
  }
  assert add(2, 3) == 5  # a Tool still calls as its function
  assert calculator.name == "calc" and calculator.description == "Evaluates + and * of whole numbers."

  def lists(xs: list[int], table: dict, mode: typing.Literal["fast", "slow"] = "fast", tags: list | None = None):
    pass

  assert Tool.from_function(lists).parameters == {
      "type": "object",
      "properties": {
          "xs": {
              "type": "array",
              "items": {
                  "type": "integer"
              }
          },
          "table": {
              "type": "object"
          },
          "mode": {
              "type": "string",
              "enum": ["fast", "slow"]
          },
          "tags": {
              "type": "array"
          }
      },
      "required": ["xs", "table"]
  }
  untyped = Tool.from_function(echo)  # no hints: strings, and no docstring: no description
  assert untyped.description == "" and untyped.parameters["properties"] == {"text": {"type": "string"}}


def test_bad_declarations_are_refused_in_one_line():

  def star(*args: str):
    pass

  def kw(**kwargs):
    pass

  def positional(x: int, /):
    pass

  def typed(x: bytes):
    pass

  cases = [
      (lambda: Tool.from_function(star),
       r"parameter 'args' is variadic positional; the model passes arguments by name"),
      (lambda: Tool.from_function(kw), r"parameter 'kwargs' is variadic keyword"),
      (lambda: Tool.from_function(positional), r"parameter 'x' is positional-only"),
      (lambda: Tool.from_function(typed), r"tool 'typed': parameter 'x' has type bytes; tool parameters take str"),
      (lambda: Tool.from_function(lambda x: x), r"tool '<lambda>': the name is not an identifier .* pass name="),
      (lambda: Tool.from_function(echo, name="two words"), r"tool 'two words': the name is not an identifier"),
      (lambda: as_tools([echo, echo]), r"two tools are named 'echo'; rename one"),
      (lambda: tool_format("json"), r"tool_format='json': expected one of \['hermes', 'tags'\]"),
      (lambda: tool_format("tags", [Tool.from_function(echo, name="result")]), r"the tags format writes results as"),
      (lambda: tool_format("tags").parse("<calc>1</calc>"),
       r"made without tools, .* pass them: tool_format\('tags', tools\)"),
  ]
  for make, message in cases:
    with pytest.raises(TaskError, match=message) as e:
      make()
    assert "\n" not in str(e.value)


def test_tags_format_parses_calls_of_its_tools():
  fmt = tool_format("tags", [add, calculator, square, echo])
  calls = fmt.parse('so <calc>12*34</calc> then <add>{"a": 1, "b": 2}</add><square>7</square> <echo>{"a": 1}</echo>')
  assert calls == [
      Call("calc", {"expression": "12*34"}, "<calc>12*34</calc>"),
      Call("add", {
          "a": 1,
          "b": 2
      }, '<add>{"a": 1, "b": 2}</add>'),
      Call("square", {"n": 7}, "<square>7</square>"),  # an int parameter: its text is read as JSON
      Call("echo", {"text": '{"a": 1}'}, '<echo>{"a": 1}</echo>'),  # a string parameter gets the text as written
  ]
  assert fmt.parse("the answer is <answer>408</answer>") == []  # not a tool: the environment's to read
  assert fmt.parse("") == []
  bad = fmt.parse('<add>{"a": 1</add> <add>[1, 2]</add> <square>seven</square> <calc>1+2')
  assert [c.error for c in bad] == [
      'add: the arguments are not JSON (Expecting \',\' delimiter: line 1 column 8 (char 7)); write '
      '<add>{"a": "...", "b": "...", "exact": "...", "note": "..."}</add>',
      'add: the arguments are not a JSON object; write '
      '<add>{"a": "...", "b": "...", "exact": "...", "note": "..."}</add>',
      "square: 'n' must be integer, not 'seven'",
      "<calc> has no </calc>; end the call with it",
  ]
  assert [c.name for c in bad] == ["add", "add", "square", "calc"] and bad[3].raw == "<calc>1+2"


def test_hermes_format_parses_tool_call_blocks():
  fmt = tool_format("hermes", [add, calculator])
  text = ('I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
          '<tool_call>\n{"name": "calc", "arguments": "{\\"expression\\": \\"2*3\\"}"}\n</tool_call>')
  calls = fmt.parse(text)
  assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {
      "a": 1,
      "b": 2
  }, None), ("calc", {
      "expression": "2*3"
  }, None)]
  assert calls[0].raw == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
  assert fmt.parse("No tool needed: 42.") == []
  shape = '; write <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>'
  bad = fmt.parse('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>'
                  '<tool_call>{"arguments": {}}</tool_call>'
                  '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'
                  '<tool_call>{"name": "add", "arguments": {"a": 1}}')
  assert [(c.name, c.error) for c in bad] == [
      ("", "the tool call is not JSON (Expecting ',' delimiter: line 1 column 38 (char 37))" + shape),
      ("", "the tool call names no tool" + shape),
      ("add", "the tool call's arguments are not a JSON object" + shape),
      ("add", "a <tool_call> has no </tool_call>" + shape),
  ]


def test_observations_and_system_prompts():
  results = [Result("calc", "408"), Result("add", "", "ValueError: no")]
  assert tool_format("tags").observation(results) == "<result>408</result><error>ValueError: no</error>"
  assert tool_format("hermes").observation(results) == [{
      "role": "tool",
      "content": "408",
      "name": "calc"
  }, {
      "role": "tool",
      "content": "Error: ValueError: no",
      "name": "add"
  }]
  assert tool_format(
      "tags", [calculator, square]).system_prompt() == ("Tools (each answers <result>...</result>):\n"
                                                        "<calc>expression</calc> Evaluates + and * of whole numbers.\n"
                                                        "<square>n</square>")
  assert tool_format("hermes", [calculator]).system_prompt() == ""  # the chat template lists the schemas


@pytest.fixture
def runner():
  r = ToolRunner([add, calculator, misbehave, pid, wait_for], timeout_s=0.5, workers=4)
  yield r
  r.close()


def test_misbehaving_tools_give_error_results_and_are_counted(runner, capfd):
  hows = ["raise", "die", "exit", "none", "bytes", "huge", "control", "object", "set", "number", "list", "print"]
  calls = [Call("misbehave", {"how": h}, "") for h in hows]
  calls += [
      Call("calc", {"expression": "12*34"}, ""),
      Call("nope", {}, "<nope>1</nope>"),
      Call("add", {"a": "1"}, ""),
      Call("add", {"b": 2}, ""),
      Call("add", {
          "a": 1,
          "c": 2
      }, ""),
      Call("", {}, "<tool_call>{</tool_call>", error="the tool call is not JSON"),
  ]
  results = runner.run(calls)
  assert [(r.name, r.text, r.error) for r in results] == [
      ("misbehave", "", "ValueError: no such thing"),
      ("misbehave", "", "its process died (exit code 7)"),
      ("misbehave", "", "SystemExit: 3"),
      ("misbehave", "", "returned None, not text; return a str"),
      ("misbehave", "", "returned bytes, not text; decode it to str"),
      ("misbehave", "", "returned 100000 characters; a result has at most 2000"),
      ("misbehave", "", "returned text with the control character '\\x00'"),
      ("misbehave", "", "returned object, not text; return a str"),
      ("misbehave", "", "returned set, not text; return a str"),
      ("misbehave", "2.5", None),
      ("misbehave", '[1, "two", null]', None),
      ("misbehave", "printed", None),
      ("calc", "408", None),
      ("nope", "", "unknown tool 'nope'; tools: ['add', 'calc', 'misbehave', 'pid', 'wait_for']"),
      ("add", "", "bad arguments for add: 'a' must be integer, not string"),
      ("add", "", "bad arguments for add: missing a required argument: 'a'"),
      ("add", "", "bad arguments for add: got an unexpected keyword argument 'c'"),
      ("", "", "the tool call is not JSON"),
  ]
  assert "garbage" not in capfd.readouterr().out  # a tool's prints never reach the run's console
  assert runner.calls == 18 and runner.errors == 14
  assert runner.errors_by_kind == {"raised": 2, "died": 1, "result": 6, "unknown": 1, "arguments": 3, "format": 1}
  assert len(runner._pool) == 4 and all(w.proc.is_alive() for w in runner._pool)  # the dead one replaced


def test_a_hung_tool_is_killed_and_the_runner_goes_on_at_full_speed(runner):
  hung = runner.run([Call("misbehave", {"how": "hang"}, ""), Call("add", {"a": 1}, "")])
  assert hung == [Result("misbehave", "", "timed out after 0.5s"), Result("add", "2.5", None)]
  assert runner.errors_by_kind == {"timeout": 1}
  workers = {w.proc.pid for w in runner._pool}
  assert len(workers) == 4 and all(w.proc.is_alive() for w in runner._pool)
  # four calls at once run on four workers, each its own process: the pool is whole again
  assert {int(r.text) for r in runner.run([Call("pid", {}, "")] * 4)} == workers
  assert runner.calls == 6 and runner.errors == 1
  runner.close()
  assert not len(runner._pool)
  assert runner.run([Call("calc", {"expression": "2*3"}, "")]) == [Result("calc", "6", None)]  # restarts


def test_threads_share_the_workers_without_waiting_on_each_other(runner, tmp_path):
  runner.timeout_s = 60.0
  release = str(tmp_path / "release")
  slow = []
  thread = threading.Thread(target=lambda: slow.extend(runner.run([Call("wait_for", {"path": release}, "")])))
  thread.start()
  while not os.path.exists(release + ".started"):  # the waiting call holds one worker
    time.sleep(0.01)
  fast = runner.run([Call("calc", {"expression": f"{i}*{i}"}, "") for i in range(6)])  # on the other three
  assert [r.text for r in fast] == ["0", "1", "4", "9", "16", "25"]
  assert thread.is_alive() and not slow  # the other thread's call is still running
  open(release, "w").close()
  thread.join()
  assert slow == [Result("wait_for", "released", None)] and runner.calls == 7 and runner.errors == 0


def test_close_ends_the_calls_in_flight_and_a_later_run_starts_anew(tmp_path):
  runner = ToolRunner([wait_for, calculator], timeout_s=60.0, workers=1)
  release, out = str(tmp_path / "release"), []
  calls = [Call("wait_for", {"path": release}, ""), Call("calc", {"expression": "1+1"}, "")]
  thread = threading.Thread(target=lambda: out.extend(runner.run(calls)))
  thread.start()
  while not os.path.exists(release + ".started"):
    time.sleep(0.01)
  runner.close()  # as a run ends with episodes still waiting on a tool
  thread.join()
  assert out == [
      Result("wait_for", "", "its process died (exit code -9)"),
      Result("calc", "", "not run: the pool was closed")
  ]
  assert runner.errors_by_kind == {"died": 1, "closed": 1}
  assert runner.run(calls[1:]) == [Result("calc", "2", None)]
  runner.close()


def test_hermes_round_trip_through_a_qwen_style_chat_template(tmp_path):
  """Schemas listed by the template, a rendered assistant tool call parsed back, results rendered
  as <tool_response> blocks (Qwen2.5's template, its tool parts)."""
  from hf_support import save_tokenizer

  from jaxrl_hex.models.tokenizer import HFTokenizer
  save_tokenizer(str(tmp_path), ["<tool_call> tool_response add calc"], vocab_size=300)
  config_file = tmp_path / "tokenizer_config.json"
  config = json.loads(config_file.read_text())
  config_file.write_text(json.dumps(dict(config, chat_template=QWEN_TOOLS_TEMPLATE)))
  tok = HFTokenizer(str(tmp_path))
  fmt = tool_format("hermes", [add, calculator])
  prompt = tok.apply_chat_template([{
      "role": "user",
      "content": "12*34+1?"
  }], tools=[t.schema() for t in fmt.tools.values()])
  assert json.dumps(calculator.schema(), ensure_ascii=False) in prompt and prompt.endswith("<|im_start|>assistant\n")

  tool_calls = [{"function": {"name": "calc", "arguments": {"expression": "12*34"}}}]
  turn = tok.apply_chat_template([{
      "role": "assistant",
      "content": "",
      "tool_calls": tool_calls
  }], add_generation_prompt=False)
  calls = fmt.parse(turn)
  assert [(c.name, c.arguments, c.error) for c in calls] == [("calc", {"expression": "12*34"}, None)]
  runner = ToolRunner(fmt.tools.values(), timeout_s=5.0, workers=1)
  try:
    messages = fmt.observation(runner.run(calls + [Call("add", {"a": 408}, "")]))
  finally:
    runner.close()
  assert tok.apply_chat_template(messages, add_generation_prompt=True) == (
      "<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n409.5\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n")


QWEN_TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.' }}
    {{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments " }}
    {{- "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
    {{- "{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
