"""Request-level routing of prompt groups over rollout replicas of differing speed.

A batch is a list of prompt groups (one prompt and its G samples: a group never splits, so its
prompt is prefilled once on one replica). Replicas pull: a replica with room in its engine asks
for a chunk and gets unstarted groups of the oldest batch that has any, as many as its share of
the fleet's throughput allots it of that batch (in `pieces` chunks, so part of every allotment
stays stealable) and its room allows. Once its allotment is taken it takes unstarted groups
wherever they are (work stealing), so a batch is done when the fleet is, not when its slowest
member is. A replica may hold several chunks at once (they share its engine's decode steps).

With `capacity` (the groups each replica's engine runs at once, its slots) a chunk runs as a
wave: its groups decode together and end together, so two groups cost a replica about what one
does. There, once every replica has finished two chunks, shares give way to earliest finish
(`_earliest_finish`): each unstarted group goes to the replica that would finish it first,
counting its free capacity now and the capacity its running chunks free when they are expected
to end. A slow replica then leaves the last groups of a batch to a fast one's next wave when that
ends sooner than its own would, instead of holding the batch for a whole slow wave.

Shares start from the planner's per-replica `share` (or equal) and follow each replica's
measured tokens/s (an exponential moving average over what the replica reports, `measure`). A
lost replica's chunks go back to the front of their batches' queues, so every group is
generated exactly once.

Pure Python and thread-safe: the Ray rollout side runs one thread per replica around it.
"""
import collections
import dataclasses
import math
import threading
import time
import typing

from jaxrl_hex.metrics import covered_seconds


def prior_shares(replicas: int, shares=None) -> list:
  """The planner's per-replica shares normalised to sum to 1; equal where they are incomplete."""
  if replicas < 1:
    raise ValueError("a router needs at least one replica")
  if shares is not None and (len(shares) != replicas or any(s is None or s <= 0 for s in shares)):
    shares = None
  total = sum(shares) if shares else replicas
  return [s / total for s in shares] if shares else [1.0 / replicas] * replicas


class RouterClosed(Exception):
  """The router was closed while a caller waited on it."""


@dataclasses.dataclass
class Chunk:
  """Groups of one batch handed to one replica."""
  batch: typing.Any  # the batch's key (the orchestrator's batch index)
  positions: list  # each group's position in its batch (record order)
  groups: list  # the groups themselves (records), in `positions` order
  replica: int
  context: typing.Any  # what the batch was added with (group size, seed, weights handle)
  started: float = 0.0
  id: int = 0  # unique over the router's life


@dataclasses.dataclass
class _Batch:
  key: typing.Any
  groups: list
  context: typing.Any
  allot: list  # per replica: groups of this batch its share gives it (float)
  taken: list  # per replica: groups of this batch it has taken
  added: float
  unstarted: collections.deque = dataclasses.field(default_factory=collections.deque)  # positions
  results: list = dataclasses.field(default_factory=list)  # (positions, result)
  done: int = 0  # groups finished
  finished: float | None = None
  error: BaseException | None = None
  per_replica: dict = dataclasses.field(default_factory=dict)  # replica -> {prompts, tokens, spans}


class Router:
  """Owns the prompt groups of every batch in flight, in batch order.

  add_batch(key, groups, context)          a batch's groups, queued unstarted
  next_chunk(replica, most, timeout)       -> Chunk of at most `most` groups; blocks until there is
                                           work (None: timeout or closed)
  finish(chunk, result, tokens)            the chunk's groups are done
  measure(replica, tokens, seconds)        the replica generated `tokens` in `seconds`: its speed
  give_back(chunk)                         a lost replica's chunk, back to the front of the queue
  fail(key, error)                         the batch's waiter raises `error`
  wait(key) -> (results, stats)            [(positions, result)] once every group of the batch is done
  """

  def __init__(self, replicas: int, shares=None, pieces: int = 1, alpha: float = 0.5, clock=time.monotonic,
               capacity=None):
    """capacity: per replica, the groups its engine runs at once (None: unlimited)."""
    self.prior = prior_shares(replicas, shares)
    self.replicas, self.pieces, self.alpha, self.clock = replicas, max(int(pieces), 1), alpha, clock
    self.limited = capacity is not None  # engines of so many slots: chunks run in waves (earliest finish)
    self.capacity = list(capacity) if capacity is not None else [math.inf] * replicas
    self.rate = [None] * replicas  # EMA of measured tokens/s
    self.stats = [{"prompts": 0, "tokens": 0, "chunks": 0, "busy_s": 0.0, "idle_s": 0.0} for _ in range(replicas)]
    self._batches = collections.OrderedDict()  # key -> _Batch, in the order they were added
    self._busy = [[] for _ in range(replicas)]  # per replica: [start, end or None] while it holds any chunk
    self._lost = set()  # replicas that gave back a chunk and have not asked for work since
    self._open = [{} for _ in range(replicas)]  # per replica: chunk id -> (started, groups) of the chunks it holds
    self.chunk_s = [None] * replicas  # EMA of a chunk's seconds from start to finish, per replica
    self._ids = 0
    self._waiting = {}  # replica -> when it started waiting (or was last credited idle time)
    self._active_since = None  # since when some batch is unfinished (idle time counts only then)
    self._cond = threading.Condition()
    self._closed = None  # None, or the exception waiters raise

  # ---- shares -----------------------------------------------------------------------------------
  def shares(self) -> list:
    """Each replica's fraction of the fleet's throughput: measured where measured, the prior
    scaled to the measured ones' units where not."""
    measured = [i for i, r in enumerate(self.rate) if r is not None]
    if not measured:
      return list(self.prior)
    scale = sum(self.rate[i] for i in measured) / sum(self.prior[i] for i in measured)
    speed = [r if r is not None else p * scale for r, p in zip(self.rate, self.prior)]
    total = sum(speed)
    return [s / total for s in speed] if total > 0 else list(self.prior)

  # ---- batches ----------------------------------------------------------------------------------
  def add_batch(self, key, groups: list, context=None):
    with self._cond:
      if key in self._batches:
        raise ValueError(f"router: batch {key!r} is already in flight")
      n, now = len(groups), self.clock()
      b = _Batch(key, list(groups), context, [s * n for s in self.shares()], [0] * self.replicas, now)
      b.unstarted.extend(range(n))
      self._batches[key] = b
      if self._active_since is None:
        self._active_since = now
      if n == 0:
        self._complete(b, now)
      self._cond.notify_all()

  def unfinished(self) -> int:
    """Batches in flight: added, some group not yet done."""
    with self._cond:
      return sum(b.finished is None for b in self._batches.values())

  def _free(self, q) -> float:
    """Groups replica q's engine can start now: its capacity less the groups of its chunks."""
    return self.capacity[q] - sum(n for _, n in self._open[q].values())

  def _chunk_size(self, b: _Batch, replica: int, most: int | None) -> int:
    """Groups `replica` takes of batch `b` now, at most its free capacity and `most` (0: nothing
    for it in `b`): a piece of its allotment; once that is taken, a piece-sized steal if it holds
    nothing, else the groups of `b` that no other replica has the allotment and the free
    capacity to start now (they would wait for a slot there; here one is free)."""
    free = self._free(replica)
    piece = max(1, math.ceil(b.allot[replica] / self.pieces - 1e-9))
    own = round(b.allot[replica] - b.taken[replica])
    if own >= 1:
      size = min(piece, own)
    elif not self._open[replica]:
      size = piece
    else:
      others = sum(
          min(max(round(b.allot[q] - b.taken[q]), 0), self._free(q)) for q in range(self.replicas) if q != replica)
      size = len(b.unstarted) - others
    size = min(size, free, len(b.unstarted))
    if most is not None:
      size = min(size, most)
    return max(0, int(size))

  def _earliest_finish(self, replica: int, most: int | None) -> dict:
    """Batch key -> how many of its unstarted groups `replica` starts now: the unstarted groups,
    oldest batch first, each go where they would finish first, by list scheduling over every
    replica but a lost one (until its replacement asks). A replica starts groups in its free capacity now
    and in the capacity each of its chunks frees when it is expected to end, then in whole waves;
    a chunk takes its replica's measured chunk seconds (`chunk_s`). So an idle slow replica
    leaves groups that a busy fast one would finish sooner, and takes the ones it would not."""
    now = self.clock()
    ready = [q for q in range(self.replicas) if q == replica or q not in self._lost]

    def free(q):  # groups q can start now: its free capacity (the asker's at most `most`)
      n = self._free(q)
      return min(n, most) if q == replica and most is not None else n

    def openings(q):  # (start, groups it can start then), in time order
      if free(q) > 0:
        yield now, free(q)
      end = now
      for started, n in sorted(self._open[q].values()):
        end = max(now, started + self.chunk_s[q])
        yield end, n
      while True:
        end += self.chunk_s[q]
        yield end, self.capacity[q]

    gens = {q: openings(q) for q in ready}
    head = {q: list(next(gens[q])) for q in ready}
    left = max(free(replica), 0)  # what the asker starts now: a chunk due by now still holds its slots
    ours = {}
    for b in self._batches.values():
      if b.error is not None:
        continue
      for _ in range(len(b.unstarted)):
        q = min(ready, key=lambda q: (head[q][0] + self.chunk_s[q], q != replica))
        if q == replica and left > 0:  # its free opening comes first: these groups are the ones in it
          ours[b.key] = ours.get(b.key, 0) + 1
          left -= 1
        head[q][1] -= 1
        if head[q][1] <= 0:
          head[q] = list(next(gens[q]))
    return ours

  def next_chunk(self, replica: int, most: int | None = None, timeout: float | None = None) -> Chunk | None:
    deadline = None if timeout is None else self.clock() + timeout
    with self._cond:
      self._lost.discard(replica)
      waiting = not self._open[replica]  # a replica with work in hand is topping up, not idle
      if waiting:
        self._waiting[replica] = self.clock()
      try:
        while self._closed is None:
          timed = self.limited and all(s["chunks"] >= 2 for s in self.stats)  # settled estimates
          ours = self._earliest_finish(replica, most) if timed else None
          b, n = next(((b, n) for b in self._batches.values() if b.unstarted and b.error is None
                       for n in [ours.get(b.key, 0) if timed else self._chunk_size(b, replica, most)] if n > 0),
                      (None, 0))
          if b is not None:
            now = self.clock()
            if waiting:
              self._credit_idle(replica, now)
            positions = [b.unstarted.popleft() for _ in range(n)]
            b.taken[replica] += n
            self._ids += 1
            self._take(replica, self._ids, now, n)
            return Chunk(b.key, positions, [b.groups[p] for p in positions], replica, b.context, now, self._ids)
          left = None if deadline is None else deadline - self.clock()
          if left is not None and left <= 0:
            break
          self._cond.wait(left)
        if waiting:
          self._credit_idle(replica, self.clock())
        return None
      finally:
        self._waiting.pop(replica, None)

  def _credit_idle(self, replica, now):
    """Waiting counts as idle only while some batch is unfinished (else the gate starves the
    fleet, not the routing)."""
    since = self._waiting.get(replica)
    if since is not None and self._active_since is not None:
      self.stats[replica]["idle_s"] += max(0.0, now - max(since, self._active_since))
    self._waiting[replica] = now

  def _take(self, replica, chunk_id, now, groups):
    """The replica takes a chunk: a busy span starts with the first chunk it holds."""
    self._open[replica][chunk_id] = (now, groups)
    if len(self._open[replica]) == 1:
      self._busy[replica].append([now, None])

  def _let_go(self, replica, chunk_id, now):
    """The replica lets go of a chunk (once, however often it is reported): its busy span ends
    with the last one it held."""
    if self._open[replica].pop(chunk_id, None) is not None and not self._open[replica]:
      span = self._busy[replica][-1]
      span[1] = now
      self.stats[replica]["busy_s"] += now - span[0]

  def measure(self, replica: int, tokens: int, seconds: float):
    """The replica generated `tokens` in `seconds` of generation (compiles and weight receives
    left out by the caller): its speed's moving average."""
    if seconds > 0 and tokens > 0:
      with self._cond:
        rate, old = tokens / seconds, self.rate[replica]
        self.rate[replica] = rate if old is None else self.alpha * rate + (1 - self.alpha) * old

  def finish(self, chunk: Chunk, result, tokens: int):
    """The chunk's groups are done: `result`, `tokens` generated."""
    with self._cond:
      now = self.clock()
      r = chunk.replica
      self._let_go(r, chunk.id, now)
      s, seconds, old = self.stats[r], now - chunk.started, self.chunk_s[r]
      # a replica's first chunk carries first-run costs (allocations, the first weights): its second
      # replaces it rather than averaging with it, and until every replica has finished two the
      # share split routes (a replica rated by its first chunk alone might never be given a second)
      self.chunk_s[r] = seconds if s["chunks"] <= 1 else self.alpha * seconds + (1 - self.alpha) * old
      self._cond.notify_all()  # freed capacity and chunk seconds change the schedule, whatever became of the batch
      s["prompts"] += len(chunk.positions)
      s["tokens"] += int(tokens)
      s["chunks"] += 1
      b = self._batches.get(chunk.batch)
      if b is None or b.error is not None:
        return
      b.results.append((list(chunk.positions), result))
      b.done += len(chunk.positions)
      mine = b.per_replica.setdefault(r, {"prompts": 0, "tokens": 0, "spans": []})
      mine["prompts"] += len(chunk.positions)
      mine["tokens"] += int(tokens)
      mine["spans"].append((chunk.started, now))
      if b.done == len(b.groups):
        self._complete(b, now)

  def give_back(self, chunk: Chunk):
    """A lost replica's unfinished chunk: its groups go back to the front of their batch's queue,
    in order, and count again toward that replica's allotment (its replacement takes them)."""
    with self._cond:
      self._let_go(chunk.replica, chunk.id, self.clock())
      self._lost.add(chunk.replica)
      b = self._batches.get(chunk.batch)
      if b is not None and b.error is None:
        b.unstarted.extendleft(reversed(chunk.positions))
        b.taken[chunk.replica] -= len(chunk.positions)
      self._cond.notify_all()

  def fail(self, key, error: BaseException):
    with self._cond:
      b = self._batches.get(key)
      if b is not None and b.error is None:
        b.error = error
        b.unstarted.clear()
        self._complete(b, self.clock())
      self._cond.notify_all()

  def _complete(self, b: _Batch, now):
    b.finished = now
    if all(x.finished is not None for x in self._batches.values()):  # the fleet has nothing in flight
      for r in list(self._waiting):
        self._credit_idle(r, now)
      self._active_since = None

  def wait(self, key, timeout: float | None = None):
    """-> ([(positions, result)] in the order they finished, the batch's stats) once every group
    is done; the batch leaves the router. Raises the batch's error, or RouterClosed."""
    with self._cond:
      b = self._batches[key]
      if not self._cond.wait_for(lambda: b.finished is not None or self._closed is not None, timeout):
        raise TimeoutError(f"router: batch {key!r} not done in {timeout} s")
      del self._batches[key]
      if b.error is not None:
        raise b.error
      if b.finished is None:
        raise self._closed
      return b.results, self._batch_stats(b)

  def _batch_stats(self, b: _Batch) -> dict:
    """Per replica over the batch's wall time: its prompts, tokens and busy seconds on this batch
    (while it held a chunk of it), and its idle seconds (the batch running, the replica holding
    no chunk of any batch)."""
    window = b.finished - b.added
    replicas = []
    for r in range(self.replicas):
      busy_any = covered_seconds([(s, e if e is not None else b.finished) for s, e in self._busy[r]], b.added,
                                 b.finished)
      mine = b.per_replica.get(r, {"prompts": 0, "tokens": 0, "spans": []})
      replicas.append({
          "replica": r,
          "prompts": mine["prompts"],
          "tokens": mine["tokens"],
          "busy_s": covered_seconds(mine["spans"], b.added, b.finished),
          "idle_s": max(0.0, window - busy_any)
      })
    oldest = min((x.added for x in self._batches.values()), default=b.finished)
    for r in range(self.replicas):  # forget chunks that ended before every batch still in flight
      self._busy[r] = [s for s in self._busy[r] if s[1] is None or s[1] >= oldest]
    return {"seconds": window, "replicas": replicas}

  def close(self, error: BaseException | None = None):
    """Wakes every caller: next_chunk returns None, waiters raise `error` (or RouterClosed)."""
    with self._cond:
      if self._closed is None:
        self._closed = error if error is not None else RouterClosed("the rollout router was closed")
      for b in self._batches.values():
        if b.finished is None:
          b.error = self._closed
          b.finished = self.clock()
      self._cond.notify_all()
