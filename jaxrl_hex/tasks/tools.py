"""Tools for agentic tasks: Python functions the model calls in the format its tokenizer suits.

A Tool is a function with a declared signature. Its type hints (str, int, float, bool, list, dict;
Optional and Literal of those) and docstring (first line; Google-style "Args:" for parameters)
make an OpenAI-style schema, which chat templates list as `tools=`. Call formats, by name:

  "tags"   for character-tokenizer tasks: the model writes <calc>123*456</calc>. A one-parameter
           tool gets the text between the tags as that parameter (JSON-decoded when its type is
           not str); other tools take a JSON object of arguments. Results come back as
           <result>TEXT</result>, failures as <error>TEXT</error>.
  "hermes" for Hugging Face chat models (Qwen2.5, Hermes): blocks of
           <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> in the turn; results are
           {"role": "tool", "content", "name"} messages, which the chat template renders.

ToolRunner runs calls isolated from the run (tasks/isolated.py), with a timeout. A tool returns
text: a str, a number or bool (str()'d), or a list or dict (written as JSON). Anything else (None,
bytes, other objects), text over max_chars characters and text with control characters other than
newlines and tabs are errors, as are a tool that raises, hangs past the timeout or kills its
process, an unknown tool, arguments that do not fit the signature and a malformed call. Every
error becomes an error result the model reads; the run goes on and counts it.
"""
import collections
import dataclasses
import functools
import inspect
import json
import numbers
import re
import threading
import types
import typing

from jaxrl_hex.tasks.isolated import IsolatedPool
from jaxrl_hex.tasks.task import TaskError

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # an identifier; OpenAI's limit is 64 characters
_ARG_DOC = re.compile(r"(\s+)(\w+)\s*(?:\(.*?\))?:\s*(.*)")  # "  name (type): description" under "Args:"


def _json_type(value) -> str:
  if value is None:
    return "null"
  return next((t for py, t in reversed(_JSON_TYPES.items()) if isinstance(value, py)), type(value).__name__)


def _fits(value, json_type: str) -> bool:
  if json_type == "number":
    return _json_type(value) in ("integer", "number")
  return _json_type(value) == json_type


def _hint_schema(hint, where: str) -> tuple[dict, bool]:
  """A type hint -> (its JSON schema, whether None is allowed)."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
    return _hint_schema(next(a for a in args if a is not type(None)), where)[0], True
  if origin is typing.Literal and args and len({type(a) for a in args}) == 1 and type(args[0]) in _JSON_TYPES:
    return {"type": _JSON_TYPES[type(args[0])], "enum": list(args)}, False
  if origin in (list, dict):
    schema = {"type": _JSON_TYPES[origin]}
    if origin is list and args:
      schema["items"] = _hint_schema(args[0], where)[0]
    return schema, False
  if hint in _JSON_TYPES:
    return {"type": _JSON_TYPES[hint]}, False
  raise TaskError(f"{where} has type {getattr(hint, '__name__', hint)}; tool parameters take str, int, float, bool, "
                  "list or dict (or Optional / Literal of them)")


def _param_docs(doc: str) -> dict:
  """Google-style "Args:" entries of a cleaned docstring -> {parameter: description}."""
  lines = doc.splitlines()
  start = next((i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:")), None)
  if start is None:
    return {}
  out, indent, name = {}, None, None
  for line in lines[start + 1:]:
    if line.strip() and not line[0].isspace():  # the next section
      break
    m = _ARG_DOC.fullmatch(line)
    if m and len(m[1]) == (indent or len(m[1])):
      indent, name = len(m[1]), m[2]
      out[name] = m[3].strip()
    elif name and line.strip():  # a continuation line
      out[name] = f"{out[name]} {line.strip()}".strip()
  return out


@dataclasses.dataclass(frozen=True)
class Tool:
  """A function the model may call. parameters: the JSON schema of its arguments."""
  fn: typing.Callable
  name: str
  description: str
  parameters: dict
  signature: inspect.Signature = dataclasses.field(repr=False)
  checks: dict = dataclasses.field(repr=False)  # parameter -> (JSON type, None allowed), for the hinted ones

  @classmethod
  def from_function(cls, fn, name: str | None = None, description: str | None = None) -> "Tool":
    name = name or getattr(fn, "__name__", "")
    if not callable(fn):
      raise TaskError(f"tool {name or fn!r}: {type(fn).__name__} is not callable; give a function")
    if not _NAME.fullmatch(name):
      raise TaskError(f"tool {name!r}: the name is not an identifier (letters, digits and _, at most 64); "
                      "pass name='my_tool'")
    try:
      signature = inspect.signature(fn)
      hints = typing.get_type_hints(fn) if inspect.isroutine(fn) else {}
    except (TypeError, ValueError, NameError) as e:
      raise TaskError(f"tool {name!r}: its signature cannot be read ({type(e).__name__}: {e})") from None
    doc = inspect.getdoc(fn) or ""
    docs = _param_docs(doc)
    properties, required, checks = {}, [], {}
    for p in signature.parameters.values():
      where = f"tool {name!r}: parameter {p.name!r}"
      if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
        raise TaskError(f"{where} is {p.kind.description}; the model passes arguments by name, so name each one")
      schema, nullable = ({"type": "string"}, False) if p.name not in hints else _hint_schema(hints[p.name], where)
      if p.name in hints:
        checks[p.name] = (schema["type"], nullable or p.default is None)
      if p.name in docs:
        schema = dict(schema, description=docs[p.name])
      properties[p.name] = schema
      if p.default is p.empty:
        required.append(p.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    summary = doc.splitlines()[0].strip() if doc else ""
    return cls(fn, name, summary if description is None else description, parameters, signature, checks)

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)

  def schema(self) -> dict:
    """The OpenAI-style function schema that chat templates take as `tools=`."""
    return {
        "type": "function",
        "function": {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters
        }
    }

  def check(self, arguments: dict) -> str | None:
    """Why `arguments` cannot call this tool, or None."""
    try:
      self.signature.bind(**arguments)
    except TypeError as e:
      return f"bad arguments for {self.name}: {e}"
    for k, v in arguments.items():
      json_type, nullable = self.checks.get(k, (None, False))
      if json_type and not (_fits(v, json_type) or (v is None and nullable)):
        return f"bad arguments for {self.name}: {k!r} must be {json_type}, not {_json_type(v)}"
    return None


def tool(fn=None, *, name: str | None = None, description: str | None = None):
  """A decorator that makes a function a Tool: `@tool`, or `@tool(name=..., description=...)`."""
  if fn is None:
    return lambda f: Tool.from_function(f, name, description)
  return Tool.from_function(fn, name, description)


def as_tools(tools) -> dict:
  """Tools or plain functions -> {name: Tool}; two tools named alike are refused."""
  out = {}
  for t in tools:
    t = t if isinstance(t, Tool) else Tool.from_function(t)
    if t.name in out:
      raise TaskError(f"tools: two tools are named {t.name!r}; rename one (Tool.from_function(fn, name=...))")
    out[t.name] = t
  return out


@dataclasses.dataclass(frozen=True)
class Call:
  """A tool call the model wrote: raw is its text; error says why it cannot run (malformed)."""
  name: str
  arguments: dict
  raw: str
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class Result:
  """A call's answer: text, or an error (then text is "")."""
  name: str
  text: str
  error: str | None = None


class TagFormat:
  """<name>ARGS</name> calls; <result>TEXT</result> / <error>TEXT</error> observations."""
  name = "tags"

  def __init__(self, tools=()):
    self.tools = as_tools(tools)
    clash = sorted({"result", "error"} & set(self.tools))
    if clash:
      raise TaskError(f"tools {clash}: the tags format writes results as <result>/<error>; rename the tool")
    names = "|".join(self.tools)
    # an opening tag without its closing one runs to the end of the turn: a malformed call
    self._call = re.compile(rf"<({names})>(.*?)(</\1>|\Z)", re.DOTALL) if names else None

  def parse(self, text: str) -> list[Call]:
    if self._call is None:  # every <word>...</word> would read as a call, an environment's <answer> too
      raise TaskError("tool_format('tags') was made without tools, so it cannot tell their calls from text; "
                      "pass them: tool_format('tags', tools)")
    calls = []
    for m in self._call.finditer(text):
      name, args, closed = m[1], m[2], m[3]
      if not closed:
        calls.append(Call(name, {}, m[0], f"<{name}> has no </{name}>; end the call with it"))
        continue
      try:
        calls.append(Call(name, self._arguments(self.tools[name], args), m[0]))
      except ValueError as e:
        calls.append(Call(name, {}, m[0], str(e)))
    return calls

  @staticmethod
  def _arguments(t: Tool, text: str) -> dict:
    """A one-parameter tool's parameter is the text (decoded as JSON unless it is a string); other
    tools' arguments are a JSON object."""
    params = t.parameters["properties"]
    if len(params) == 1:
      (param, schema), = params.items()
      if schema["type"] == "string":
        return {param: text}
      try:
        return {param: json.loads(text)}
      except ValueError:
        raise ValueError(f"{t.name}: {param!r} must be {schema['type']}, not {text!r}") from None
    if not params and not text.strip():
      return {}
    shape = f"write <{t.name}>{_keys_hint(t)}</{t.name}>"
    try:
      arguments = json.loads(text)
    except ValueError as e:
      raise ValueError(f"{t.name}: the arguments are not JSON ({e}); {shape}") from None
    if not isinstance(arguments, dict):
      raise ValueError(f"{t.name}: the arguments are not a JSON object; {shape}")
    return arguments

  def observation(self, results: typing.Sequence[Result]) -> str:
    return "".join(f"<result>{r.text}</result>" if r.error is None else f"<error>{r.error}</error>" for r in results)

  def system_prompt(self) -> str:
    """One line per tool: how to call it and what it does."""
    if not self.tools:
      return ""
    lines = [f"<{t.name}>{_keys_hint(t)}</{t.name}> {t.description}".rstrip() for t in self.tools.values()]
    return "\n".join(["Tools (each answers <result>...</result>):"] + lines)


def _keys_hint(t: Tool) -> str:
  params = list(t.parameters["properties"])
  if len(params) == 1:
    return params[0]
  return json.dumps({p: "..." for p in params}) if params else ""


class HermesFormat:
  """<tool_call> JSON blocks; {"role": "tool"} message observations (Qwen2.5 / Hermes chat templates)."""
  name = "hermes"
  _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
  _SHAPE = '<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>'

  def __init__(self, tools=()):
    self.tools = as_tools(tools)

  def parse(self, text: str) -> list[Call]:
    calls = []
    for m in self._CALL.finditer(text):
      name, arguments, error = self._read(m[1].strip())
      if not m[2]:
        error = f"a <tool_call> has no </tool_call>; write {self._SHAPE}"
      calls.append(Call(name, arguments, m[0], error))
    return calls

  def _read(self, body: str) -> tuple[str, dict, str | None]:
    """A call's JSON -> (name, arguments, error)."""
    try:
      obj = json.loads(body)
    except ValueError as e:
      return "", {}, f"the tool call is not JSON ({e}); write {self._SHAPE}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
      return "", {}, f"the tool call names no tool; write {self._SHAPE}"
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
      try:
        arguments = json.loads(arguments)
      except ValueError:
        pass
    if not isinstance(arguments, dict):
      return obj["name"], {}, f"the tool call's arguments are not a JSON object; write {self._SHAPE}"
    return obj["name"], arguments, None

  def observation(self, results: typing.Sequence[Result]) -> list[dict]:
    return [{
        "role": "tool",
        "content": r.text if r.error is None else f"Error: {r.error}",
        "name": r.name
    } for r in results]

  def system_prompt(self) -> str:
    return ""  # the chat template lists the tools' schemas (tools=[t.schema() ...])


FORMATS = {f.name: f for f in (TagFormat, HermesFormat)}


def tool_format(name: str, tools=()) -> TagFormat | HermesFormat:
  """The call format `name` ("tags" or "hermes") for these tools (Tools or plain functions). The
  tags format parses only calls of its tools: without them it renders observations only."""
  if name not in FORMATS:
    raise TaskError(f"tool_format={name!r}: expected one of {sorted(FORMATS)} (tags for character tokenizers, "
                    "hermes for chat models such as Qwen)")
  return FORMATS[name](tools)


def _as_text(value, max_chars: int) -> tuple[str | None, str | None]:
  """A tool's return value -> (text, None) or (None, why it is not a result)."""
  if isinstance(value, str):
    text = value
  elif isinstance(value, numbers.Number):
    text = str(value)
  elif isinstance(value, (list, dict)):
    try:
      text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
      return None, f"returned a {type(value).__name__} that is not JSON ({e}); return text"
  elif isinstance(value, (bytes, bytearray)):
    return None, f"returned {type(value).__name__}, not text; decode it to str"
  else:
    return None, f"returned {'None' if value is None else type(value).__name__}, not text; return a str"
  if len(text) > max_chars:
    return None, f"returned {len(text)} characters; a result has at most {max_chars}"
  bad = next((c for c in text if not c.isprintable() and c not in "\n\r\t"), None)
  if bad is not None:
    return None, f"returned text with the control character {bad!r}"
  return text, None


def _invoke(tools, max_chars, name, arguments):
  """In a worker process: one call -> (text, None) or (None, why the result is not text)."""
  return _as_text(tools[name].fn(**arguments), max_chars)


class ToolRunner:
  """Runs calls isolated from the run, each with a timeout. Counters: calls, errors, and
  errors_by_kind (format, unknown, arguments, raised, timeout, died, result, closed). Several threads may
  call run at once; the calls of one run execute in parallel on the workers."""

  def __init__(self, tools, timeout_s: float, workers: int = 4, max_chars: int = 2000):
    self.tools, self.timeout_s = as_tools(tools), timeout_s
    self._pool = IsolatedPool(functools.partial(_invoke, self.tools, max_chars), workers, "tool", quiet=True)
    self._lock = threading.Lock()
    self.calls = self.errors = 0
    self.errors_by_kind = collections.Counter()

  def run(self, calls: typing.Sequence[Call]) -> list[Result]:
    """One Result per call, in order."""
    errors = [self._refusal(c) for c in calls]  # (error, kind) of the calls that cannot run, else None
    runnable = [i for i, e in enumerate(errors) if e is None]
    outcomes = self._pool.run([(calls[i].name, calls[i].arguments) for i in runnable], self.timeout_s)
    texts = [""] * len(calls)
    for i, o in zip(runnable, outcomes):
      if o.error is not None:
        errors[i] = (o.error, o.kind)
        continue
      text, error = o.value
      if error is None:
        texts[i] = text
      else:
        errors[i] = (error, "result")
    failed = [e for e in errors if e is not None]
    with self._lock:
      self.calls += len(calls)
      self.errors += len(failed)
      self.errors_by_kind.update(kind for _, kind in failed)
    return [Result(c.name, text, e[0] if e else None) for c, text, e in zip(calls, texts, errors)]

  def _refusal(self, call: Call) -> tuple[str, str] | None:
    if call.error is not None:
      return call.error, "format"
    if call.name not in self.tools:
      return f"unknown tool {call.name!r}; tools: {sorted(self.tools)}", "unknown"
    error = self.tools[call.name].check(call.arguments)
    return None if error is None else (error, "arguments")

  def close(self):
    self._pool.close()
