"""Episodes of agents written against the `openai` client, through an OpenAI-compatible endpoint.

AgentStream serves `/v1/chat/completions` (and `/v1/models`) on a local port with the standard
library's ThreadingHTTPServer. Each episode gets its own base URL,
http://HOST:PORT/episodes/<id>/v1, and its own thread, which runs the task's
`agent(openai.OpenAI(base_url=..., api_key="jaxrl-hex"), record)` and returns its reward.

The engine has one driver: advance(). HTTP handler threads only render a call into tokens and
queue a turn for it with a Future; advance() submits it (an episode's first call: a held request,
engine.submit; later calls: engine.extend of the session the previous reply left, so the KV of the
history is reused), polls the engine and resolves the Future with the samples, which the handler
answers in OpenAI's format (tool calls parsed with the task's tool format, logprobs when asked).

An episode is ONE token sequence. A call must continue the episode's conversation: the previous
call's messages, then the model's reply (its content and/or tool_calls, as served), then the new
messages, whose tokens (tool results in the task's tool format) are context; the model's replies are
trained (behaviour logprobs, versions). A call that rewrites the history is refused (400) and ends
its episode on a fault; so do an agent that raises, returns something that is not a number, or
runs past AgentTask.agent_timeout_s of its own time (reward 0, counted; the run goes on). Past
AgentTask.max_turns calls or the episode's token budget (rollout.max_new_tokens) a call is refused
(400) and the episode is truncated: the agent's return value is still its reward (0 if it raises).

With n > 1 a call is served n samples; the next call continues the one it sends back and the
others are dropped. When the episode ends after such a call, its first choice is trained. A later
call with n > 1 starts n fresh sequences from the episode's row (a prefill of the whole row), which
must then fit rollout.max_prompt_len.
"""
import concurrent.futures
import dataclasses
import http.server
import json
import logging
import math
import re
import threading
import time
import typing

import jax

from jaxrl_hex.errors import UserError
from jaxrl_hex.rollout.engine import Request
from jaxrl_hex.rollout.episodes import Episode, assemble
from jaxrl_hex.tasks.agent import content_text, context_tokens, prompt_tokens

API_KEY = "jaxrl-hex"  # any key is accepted; the client needs one
_WAIT_S = 0.05  # longest an idle engine waits for an agent before it looks for news
_PATH = re.compile(r"(?:/episodes/(\d+))?/v1/(chat/completions|models)/?")


class ApiError(Exception):
  """An answer in OpenAI's error format: {"error": {"message", "type", "param", "code"}}."""

  def __init__(self, status: int, message: str, param: str | None = None):
    super().__init__(message)
    self.status, self.param = status, param

  def body(self) -> dict:
    kind = "invalid_request_error" if self.status < 500 else "server_error"
    return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclasses.dataclass
class _Params:
  """A chat completion call's parameters, checked."""
  messages: list
  n: int = 1
  max_tokens: int | None = None
  logprobs: bool = False
  seed: int | None = None
  stop: tuple = ()
  tools: list | None = None
  parse_calls: bool = False
  model: str = ""


@dataclasses.dataclass
class _Agent:
  """One episode's agent: its thread's result, and the conversation the endpoint has served it."""
  id: int
  ep: Episode
  record: dict
  key: typing.Any  # the PRNG key of the episode's fresh requests
  result: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
  messages: list = dataclasses.field(default_factory=list)  # the last call's messages
  tools: typing.Any = None  # the first call's tools: a chat template listed them in the first prompt
  choices: list = dataclasses.field(default_factory=list)  # the last call's samples, one of which goes on
  replies: list = dataclasses.field(default_factory=list)  # the assistant messages served for them
  names: dict = dataclasses.field(default_factory=dict)  # tool_call_id -> tool name, of the served calls
  calls: int = 0
  busy: bool = False  # a call is in flight
  closed: bool = False  # truncated: no more calls; the episode ends when the agent returns
  own_s: float = 0.0  # the agent's own time before idle_since (its calls' waits excluded)
  idle_since: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class _Call:
  """A call's turn for the engine, queued by its handler for advance()."""
  agent: _Agent
  no: int  # the episode's call number (from 1): with the agent's id, the engine request's id
  n: int
  future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
  request: Request | None = None  # a fresh sequence: the first call, or n > 1 later
  extend: tuple | None = None  # (session, context tokens, max_tokens, stop): a later call, n = 1
  drop: list = dataclasses.field(default_factory=list)  # sessions let go before it
  samples: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Chunk:
  agents: list
  group_size: int
  group_ids: typing.Any


class _Server(http.server.ThreadingHTTPServer):
  block_on_close = False  # close() does not wait for the handlers of connections agents keep open
  request_queue_size = 1024  # every episode of a batch connects at once (the default backlog, 5, refuses them)

  def __init__(self, address, stream):
    super().__init__(address, _Handler)
    self.stream = stream


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"  # keep-alive: an agent's client reuses its connection

  def do_GET(self):  # noqa: N802 -- http.server's name
    self._answer(*self.server.stream.get(self.path))

  def do_POST(self):  # noqa: N802
    body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
    self._answer(*self.server.stream.post(self.path, body))

  def _answer(self, status: int, obj: dict):
    data = json.dumps(obj).encode()
    try:
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)
    except OSError:  # the agent went away (it timed out, or its thread was left behind)
      self.close_connection = True

  def log_message(self, *args):
    pass  # a line per call would drown the run's output


class AgentStream:
  """submit(key, records, group_size, rng, group_ids) starts a chunk's episodes (group_size agents
  per record, each in its own thread); advance() drives the engine with their calls and returns
  [(key, Rollout)] of the chunks whose episodes all ended. turn_tokens caps a call's new tokens (0:
  no cap but the episode's budget, the engine's max_new_tokens). host/port: where the endpoint
  listens (port 0: any free one; `url` says which)."""

  def __init__(self, engine, task, turn_tokens: int = 0, host: str = "127.0.0.1", port: int = 0):
    if jax.process_count() > 1:  # agents' calls arrive when their threads make them: no two processes agree
      raise UserError(f"task {task.name!r}: an agent's episodes run on a pool of one process, but this one spans "
                      f"{jax.process_count()}; warm-start on one process (jaxrl-hex sft, then --config.init_from) "
                      "or give the pool one process")
    self.engine, self.task = engine, task
    self.turn_tokens = int(turn_tokens)
    self.faults = 0
    self._chunks = {}  # key -> _Chunk, in submission order
    self._agents = {}  # id -> _Agent, until its chunk is assembled
    self._calls = {}  # (agent id, call no) -> _Call in the engine
    self._inbox, self._drops = [], []  # calls and sessions for advance() to hand the engine
    self._ids = 0
    self._lock = threading.Lock()
    self._news = threading.Event()  # a call was queued or an agent returned
    self._closed = False
    self._warned = False
    self._server = _Server((host, port), self)
    self.url = f"http://{host}:{self._server.server_address[1]}"
    threading.Thread(target=self._server.serve_forever, args=(0.1,), name="agent-endpoint", daemon=True).start()

  def base_url(self, agent_id: int) -> str:
    """The OpenAI base URL of one episode."""
    return f"{self.url}/episodes/{agent_id}/v1"

  # ---- the chunk interface (rollout.stream.ChunkStream's) ---------------------------------------
  def submit(self, key, records: list, group_size: int, rng, group_ids=None):
    if key in self._chunks:
      raise ValueError(f"chunk {key!r} is already in the stream")
    group_ids = list(range(len(records))) if group_ids is None else list(group_ids)
    chunk = _Chunk([], group_size, group_ids)
    for i, (record, gid) in enumerate(zip(records, group_ids)):
      gkey = jax.random.fold_in(rng, int(gid))
      for j in range(group_size):  # episode j of a group: fold_in(the group's key, j)
        self._ids += 1
        a = _Agent(self._ids, Episode(key, i * group_size + j, None, []), record, jax.random.fold_in(gkey, j))
        chunk.agents.append(a)
    with self._lock:
      self._chunks[key] = chunk
      self._agents.update((a.id, a) for a in chunk.agents)
    for a in chunk.agents:
      threading.Thread(target=self._run_agent, args=(a,), name=f"agent-{a.id}", daemon=True).start()

  @property
  def rows(self) -> int:
    """Episodes not yet ended."""
    return sum(not a.ep.done for c in self._chunks.values() for a in c.agents)

  def __len__(self) -> int:
    return len(self._chunks)

  def advance(self, max_s: float = 0.0, group_size: int = 1, arrived=lambda: False) -> list:
    """Hands the agents' calls to the engine, runs it and ends the episodes whose agents returned
    -> [(key, Rollout)] of the chunks that finished. Returns after one round, or with max_s > 0
    once a chunk finishes, `arrived()`, or max_s passed. (group_size: the chunk interface's; an
    agent's calls come when it makes them, so an engine with room waits for them.)"""
    t0, done = time.perf_counter(), []
    engine = self.engine
    while self._chunks:
      self._news.clear()
      self._collect_agents()
      self._hand_over()
      if engine.queued or engine.free_slots < engine.num_slots:
        for sample in engine.poll():
          self._on_sample(sample)
      else:  # every episode is with its agent: wait for a call or a return
        self._news.wait(min(_WAIT_S, max(max_s - (time.perf_counter() - t0), 0.0)))
      done = [k for k, c in self._chunks.items() if all(a.ep.done for a in c.agents)]
      if done or arrived() or time.perf_counter() - t0 >= max_s:
        break
    self._hand_over()  # the sessions of episodes that ended since (a handler's refusal) go now
    return [(k, self._assemble(k)) for k in done]

  def run(self, records: list, group_size: int, rng, group_ids=None) -> tuple:
    """A whole chunk on an otherwise idle stream -> (Rollout, its Episodes in row order)."""
    self.submit("run", records, group_size, rng, group_ids)
    episodes = [a.ep for a in self._chunks["run"].agents]
    while True:
      finished = self.advance(max_s=1.0, group_size=self.engine.num_slots + 1)
      if finished:
        return finished[0][1], episodes

  def _assemble(self, key):
    with self._lock:
      chunk = self._chunks.pop(key)
      for a in chunk.agents:
        del self._agents[a.id]
    return assemble([a.ep for a in chunk.agents], chunk.group_ids, chunk.group_size, self.engine.max_new_tokens,
                    self.engine.tokenizer.pad_id)

  def close(self):
    """Stops the endpoint; calls in flight are answered 503 and agents still running are left behind."""
    with self._lock:
      self._closed = True
      pending = [c.future for c in list(self._calls.values()) + self._inbox]
      self._calls, self._inbox = {}, []
    for f in pending:
      if not f.done():
        f.set_exception(ApiError(503, "the rollout stream closed"))
    self._server.shutdown()
    self._server.server_close()

  # ---- the agents' threads ----------------------------------------------------------------------
  def _run_agent(self, a: _Agent):
    client = None
    try:
      client = self._client(a.id)
      a.result.set_result(self.task.agent(client, a.record))
    except BaseException as e:  # noqa: BLE001 -- a user's agent: any failure is its episode's
      a.result.set_exception(e)
    finally:
      if client is not None:
        client.close()
      self._news.set()

  def _client(self, agent_id: int):
    import openai  # only agent tasks need the client (the test extra installs it)
    # plain local HTTP: no certificates to load (~4 ms a client instead of ~60), no proxy from the
    # environment; no retries: a call the endpoint received is a turn of the episode
    http = openai.DefaultHttpxClient(verify=False, trust_env=False)
    return openai.OpenAI(base_url=self.base_url(agent_id), api_key=API_KEY, max_retries=0, http_client=http)

  def _collect_agents(self):
    """Ends the episodes whose agents returned, raised or ran out of their own time."""
    now, limit = time.monotonic(), self.task.agent_timeout_s
    with self._lock:
      for a in list(self._agents.values()):
        if a.ep.done:
          continue
        if a.result.done():
          self._end(a, *_reward(a.result, a.ep.truncated))
        elif a.own_s + (0.0 if a.busy else now - a.idle_since) > limit:
          self._end(a, fault=f"the agent ran {limit}s of its own time without returning (AgentTask.agent_timeout_s)")

  # ---- the engine's side (advance's thread) -----------------------------------------------------
  def _hand_over(self):
    """The queued calls' turns and the sessions let go, to the engine."""
    with self._lock:
      calls, drops, self._inbox, self._drops = self._inbox, self._drops, [], []
    self._let_go(drops)
    for call in calls:
      self._let_go(call.drop)
      if call.agent.ep.done:  # ended while its call waited (its agent's time ran out)
        self._let_go([call.extend[0]] if call.extend else [])
        call.future.set_exception(ApiError(400, f"episode {call.agent.id} has ended: {call.agent.ep.fault}"))
        continue
      self._calls[call.agent.id, call.no] = call
      try:
        if call.request is not None:
          self.engine.submit([call.request])
        else:
          session, tokens, max_tokens, stop = call.extend
          self.engine.extend(session, tokens, max_tokens=max_tokens, id=(call.agent.id, call.no), stop=stop)
      except UserError as e:
        del self._calls[call.agent.id, call.no]
        with self._lock:
          self._end(call.agent, fault=f"the engine refused its call: {e}")
        call.future.set_exception(ApiError(400, str(e)))

  def _let_go(self, sessions):
    for session in sessions:
      if session is not None:  # (engine.drop(None) would let go of every fresh request's samples)
        self.engine.drop(session)

  def _on_sample(self, sample):
    call = self._calls.get(sample.request_id)
    if call is None or call.agent.ep.done:  # its episode ended meanwhile: let the sequence go
      self._let_go([sample.session])
      if call is not None:
        del self._calls[sample.request_id]
        call.future.set_exception(ApiError(400, f"episode {call.agent.id} has ended: {call.agent.ep.fault}"))
      return
    call.samples.append(sample)
    if len(call.samples) == call.n:
      del self._calls[sample.request_id]
      call.future.set_result(sorted(call.samples, key=lambda s: s.index))

  # ---- the HTTP side (handler threads) ----------------------------------------------------------
  def get(self, path: str) -> tuple[int, dict]:
    m = _PATH.fullmatch(path.split("?")[0])
    if not m or m[2] != "models":
      return 404, ApiError(404, f"no GET {path} here; the endpoint serves /v1/models and /v1/chat/completions").body()
    return 200, {
        "object": "list",
        "data": [{
            "id": self.task.name,
            "object": "model",
            "created": 0,
            "owned_by": "jaxrl-hex"
        }]
    }

  def post(self, path: str, body: bytes) -> tuple[int, dict]:
    m = _PATH.fullmatch(path.split("?")[0])
    try:
      if not m or m[2] != "chat/completions":
        raise ApiError(404, f"no POST {path} here; an episode's calls go to its base URL + /chat/completions")
      with self._lock:
        a = self._agents.get(int(m[1] or 0))
      if a is None:
        raise ApiError(
            404, f"no episode {m[1]} on this endpoint (it ended, or the base URL is not the one the "
            "agent was given)")
      try:
        request = json.loads(body or b"{}")
      except ValueError as e:
        raise ApiError(400, f"the body is not JSON: {e}") from None
      return 200, self._chat(a, _params(request, self.engine))
    except ApiError as e:
      return e.status, e.body()
    except UserError as e:  # messages the tokenizer or the chat template cannot render
      return 400, ApiError(400, f"messages: {e}", "messages").body()
    except Exception as e:  # noqa: BLE001 -- answered, so the agent sees it, and logged
      logging.exception("agent endpoint: %s failed", path)
      return 500, ApiError(500, f"{type(e).__name__}: {e}").body()

  def _chat(self, a: _Agent, p: _Params) -> dict:
    """One call of an episode: its turn queued, the samples awaited -> the chat completion."""
    with self._lock:
      call = self._turn(a, p)
      self._inbox.append(call)
      a.busy, a.calls, a.messages = True, a.calls + 1, p.messages
      a.own_s += time.monotonic() - a.idle_since
    self._news.set()
    try:
      samples = call.future.result()
    finally:
      with self._lock:
        a.busy, a.idle_since = False, time.monotonic()
    with self._lock:
      if a.ep.done:  # ended by another call of the episode while this one's samples came back
        self._drops += [s.session for s in samples]
        raise ApiError(400, f"episode {a.id} has ended: {a.ep.fault}")
      a.choices = samples
      a.replies = [self._reply(a, call.no, i, s, p) for i, s in enumerate(samples)]
      prompt = len(a.ep.prompt) + len(a.ep.tokens)
    return {
        "id": f"chatcmpl-{a.id}-{call.no}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": p.model or self.task.name,
        "choices": [
            dict(index=i, message=r["message"], finish_reason=r["finish_reason"],
                 logprobs=self._logprobs(s) if p.logprobs else None) for i, (s, r) in enumerate(zip(samples, a.replies))
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": sum(len(s.tokens) for s in samples),
            "total_tokens": prompt + sum(len(s.tokens) for s in samples),
        },
    }

  def _turn(self, a: _Agent, p: _Params) -> _Call:
    """A call's turn (caller holds the lock): the first prompt, or the previous reply it continues
    and the new context; refuses a call that does not fit the episode."""
    if self._closed:
      raise ApiError(503, "the rollout stream closed")
    if a.ep.done or a.closed:
      raise ApiError(400, f"episode {a.id} is over ({a.ep.fault or 'truncated'}); return the agent's reward")
    if a.busy:
      self._end(a, fault="two calls at once: an episode is one conversation")
      raise ApiError(
          400, f"episode {a.id} already has a call in flight; an episode is one conversation: make its "
          "calls one after another (the episode ends here, on a fault)")
    if a.calls >= self.task.max_turns:
      self._truncate(a)
      raise ApiError(
          400, f"episode {a.id} is over its turn limit: AgentTask.max_turns={self.task.max_turns} calls; "
          "the episode is truncated, return its reward")
    no, engine = a.calls + 1, self.engine
    if p.parse_calls and not self.task.tools and self.task.tool_format == "tags":
      raise ApiError(
          400, f"tools: the agent task {self.task.name!r} has no tools (AgentTask.tools), so the tags "
          "format cannot tell their calls from text; give the task its tools", "tools")
    if a.calls == 0:
      prompt = prompt_tokens(self.task, p.messages, p.tools)
      if len(prompt) > engine.max_prompt_len:
        self._end(a, fault=f"its first prompt is {len(prompt)} tokens, over rollout.max_prompt_len")
        raise ApiError(
            400, f"the first prompt is {len(prompt)} tokens, over rollout.max_prompt_len="
            f"{engine.max_prompt_len}; raise it or shorten the messages (the episode ends here)", "messages")
      a.ep.prompt, a.tools = prompt, p.tools
      a.ep.transcript.append({"role": "agent", "text": engine.tokenizer.decode(prompt)})
      key = a.key if p.seed is None else jax.random.key(p.seed)
      return _Call(a, no, p.n, request=Request(prompt, p.n, self._budget(0, p), p.stop, (a.id, no), key, hold=True))
    i, new = self._continuation(a, p)
    tokens = context_tokens(self.task, new, a.names)
    reply = a.choices[i]
    used = len(a.ep.tokens) + len(reply.tokens) + len(tokens)
    budget = self._budget(used, p)
    if budget < 1:
      self._truncate(a, i)
      raise ApiError(
          400, f"episode {a.id} is over its token budget: rollout.max_new_tokens="
          f"{engine.max_new_tokens} tokens after the first prompt; the episode is truncated, return its "
          "reward")
    if p.n > 1 and len(a.ep.prompt) + used > engine.max_prompt_len:
      raise ApiError(
          400, f"n={p.n}: a later call with n > 1 starts n sequences from the episode's "
          f"{len(a.ep.prompt) + used} tokens, over rollout.max_prompt_len={engine.max_prompt_len}; ask n=1", "n")
    session = self._commit(a, i)
    a.ep.add(tokens, False)
    a.ep.transcript.append({"role": "agent", "text": engine.tokenizer.decode(tokens)})
    if p.n == 1:
      return _Call(a, no, 1, extend=(session, tokens, budget, p.stop))
    key = jax.random.fold_in(a.key, no) if p.seed is None else jax.random.key(p.seed)
    row = a.ep.prompt + a.ep.tokens
    return _Call(a, no, p.n, request=Request(row, p.n, budget, p.stop, (a.id, no), key, hold=True), drop=[session])

  def _continuation(self, a: _Agent, p: _Params) -> tuple[int, list]:
    """-> (which served choice the call continues, the messages after it); a call that does not
    continue the conversation ends the episode on a fault."""
    k = len(a.messages)
    if (p.tools if p.tools is not None else a.tools) != a.tools:
      why = "its tools differ from the first call's (the first prompt listed those)"
    elif len(p.messages) <= k or [_norm(m) for m in p.messages[:k]] != [_norm(m) for m in a.messages]:
      why = f"its first {k} messages are not the previous call's"
    else:
      sent = _norm(p.messages[k])[:3]  # role, content, tool calls
      i = next((i for i, r in enumerate(a.replies) if _norm(r["message"])[:3] == sent), None)
      if i is not None:
        if len(p.messages) == k + 1:
          raise ApiError(
              400, "messages: nothing follows the model's reply; add the next message (a tool result, the "
              "user's turn)", "messages")
        return i, p.messages[k + 1:]
      why = f"message {k} is not the model's reply (send it back as served: its content and tool_calls)"
    self._end(a, fault=f"the agent rewrote its conversation: {why}")
    raise ApiError(
        400, f"episode {a.id}: this call does not continue the episode's conversation ({why}); an episode "
        "is one token sequence, so the episode ends here, on a fault", "messages")

  def _budget(self, used: int, p: _Params) -> int:
    """New tokens a call may sample: what is left of the episode's budget, capped by turn_tokens and
    the call's max_tokens."""
    left = self.engine.max_new_tokens - used
    caps = [c for c in (self.turn_tokens, p.max_tokens) if c]
    return min([left] + caps)

  def _reply(self, a: _Agent, no: int, i: int, s, p: _Params) -> dict:
    """A sample as an OpenAI choice: {message: {role, content, tool_calls}, finish_reason}."""
    text = s.text
    if s.finish_reason == "stop":  # OpenAI leaves the stop sequence out
      cuts = [text.find(x) for x in self.engine.stop + p.stop if x in text]
      text = text[:min(cuts)] if cuts else text
    calls = [c for c in self.task.call_format.parse(text) if c.error is None] if p.parse_calls else []
    message = {"role": "assistant", "content": None}
    tool_calls = []
    for k, c in enumerate(calls):
      text = text.replace(c.raw, "", 1)
      tool_calls.append({
          "id": f"call_{a.id}_{no}_{i}_{k}",
          "type": "function",
          "function": {
              "name": c.name,
              "arguments": json.dumps(c.arguments)
          }
      })
      a.names[tool_calls[-1]["id"]] = c.name
    message["content"] = (text.strip() if calls else text) or None
    if tool_calls:
      message["tool_calls"] = tool_calls
    reason = "tool_calls" if tool_calls else ("length" if s.finish_reason == "length" else "stop")
    return {"message": message, "finish_reason": reason}

  def _logprobs(self, s) -> dict:
    tok = self.engine.tokenizer
    pieces = [tok.decode([t]) for t in s.tokens.tolist()]
    return {
        "content": [{
            "token": t,
            "logprob": float(lp),
            "bytes": list(t.encode()),
            "top_logprobs": []
        } for t, lp in zip(pieces, s.logprobs.tolist())]
    }

  # ---- an episode's state (caller holds the lock) -----------------------------------------------
  def _commit(self, a: _Agent, i: int):
    """The choice the episode goes on with: its tokens trained, the others' sessions let go ->
    its session."""
    s, reply = a.choices[i], a.replies[i]
    a.ep.add(s.tokens, True, s.logprobs, s.versions)
    a.ep.turns += 1
    a.ep.tool_calls += len(reply["message"].get("tool_calls", []))
    a.ep.transcript.append({"role": "model", "text": s.text})
    if s.finish_reason == "length" and len(a.ep.tokens) >= self.engine.max_new_tokens:
      a.ep.truncated = True
    self._drops += [c.session for j, c in enumerate(a.choices) if j != i]
    a.choices, a.replies = [], []
    return s.session

  def _close(self, a: _Agent, i: int = 0):
    """No more calls: the last reply (choice i) is the episode's last turn, its session let go."""
    if a.choices:
      self._drops.append(self._commit(a, i))
    a.closed = True

  def _truncate(self, a: _Agent, i: int = 0):
    self._close(a, i)
    a.ep.truncated = True

  def _end(self, a: _Agent, reward: float = 0.0, fault: str | None = None):
    if a.ep.done:
      return
    self._close(a)
    a.ep.reward, a.ep.done = reward, True
    if fault is not None:
      a.ep.fault = fault
      self.faults += 1
      if not self._warned:
        logging.warning("agent task %r: an episode ended on a fault (counted as episode_faults): %s", self.task.name,
                        fault)
        self._warned = True


def _params(body, engine) -> _Params:
  """A call's JSON body -> its parameters; refuses what the endpoint cannot serve (400)."""
  if not isinstance(body, dict):
    raise ApiError(400, "the body is not a JSON object of chat completion parameters")
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
    raise ApiError(400, "messages: give a non-empty list of {role, content} messages", "messages")
  if body.get("stream"):
    raise ApiError(400, "stream=true is not served: the endpoint answers whole completions; call without stream",
                   "stream")
  temperature = body.get("temperature")
  own = engine.sampling["temperature"]
  if temperature is not None and not engine.greedy and not (_number(temperature) and math.isclose(temperature, own)):
    raise ApiError(
        400, f"temperature={temperature}: this endpoint samples at the rollout engine's temperature {own} "
        "(rollout.temperature), the one the trainer scores its tokens at; leave temperature out or pass "
        f"{own} (greedy decoding, 0, is how held-out episodes run: there every call is greedy)", "temperature")
  stop = body.get("stop")
  stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
  if not all(isinstance(x, str) and x for x in stop):
    raise ApiError(400, f"stop={body.get('stop')!r}: give a string or a list of non-empty strings", "stop")
  tools = body.get("tools")
  if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
    raise ApiError(400, "tools: give a list of {type: function, function: {name, description, parameters}}", "tools")
  max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
  return _Params(messages, n=_int("n", body.get("n"), 1, engine.num_slots,
                                  default=1), max_tokens=_int("max_tokens", max_tokens, 1),
                 logprobs=bool(body.get("logprobs")), seed=_int("seed", body.get("seed"), 0), stop=stop, tools=tools,
                 parse_calls=bool(tools) and body.get("tool_choice") != "none", model=str(body.get("model") or ""))


def _number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int(name: str, value, low: int, high: int | None = None, default=None):
  """A parameter that is an integer in [low, high] (high None: no bound), or default when absent."""
  if value is None:
    return default
  if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
    bounds = f"from {low}" + (f" to {high} (rollout.slots: a call's samples decode at once)" if high else " up")
    raise ApiError(400, f"{name}={value!r}: give an integer {bounds}", name)
  return value


def _norm(m) -> tuple:
  """A message as the conversation compares it: role, text, tool calls (name, arguments decoded)."""
  calls = []
  for c in m.get("tool_calls") or ():
    f = c.get("function") or {} if isinstance(c, dict) else {}
    args = f.get("arguments")
    try:
      args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
      pass
    calls.append((f.get("name"), args))
  return m.get("role"), content_text(m.get("content")), calls, m.get("tool_call_id"), m.get("name")


def _reward(result: concurrent.futures.Future, truncated: bool) -> tuple[float, str | None]:
  """A returned agent's (reward, fault): a finite number, else 0 and why. An agent that raises once
  its episode was truncated (its call answered 400) scores 0 without a fault."""
  error = result.exception()
  if error is not None:
    return 0.0, None if truncated else f"the agent raised {type(error).__name__}: {error}"
  value = result.result()
  try:
    if isinstance(value, (str, bytes)):
      raise TypeError
    reward = float(value)
  except (TypeError, ValueError):
    return 0.0, f"the agent returned {value!r:.60}, not a number (its reward)"
  if not math.isfinite(reward):
    return 0.0, f"the agent returned {reward}, not a finite reward"
  return reward, None
