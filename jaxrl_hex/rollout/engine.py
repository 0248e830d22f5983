"""The rollout engine: continuous batching over a fixed number of decode slots on the rollout mesh.

Requests wait in a FIFO queue; a request for n samples takes n free slots at once and its
prompt is prefilled once for all of them (shared group prefill). One jitted loop decodes all
slots for up to `steps_per_sync` steps and hands back to the host as soon as a slot finishes
while requests are waiting, so a freed slot is refilled at the next step instead of idling
until the slowest sequence of a batch is done. Prefill shapes are bucketed (prompt count and
length to powers of two), so a run compiles a handful of programs (`compile_count`).

Weights can change mid-generation (`load_weights` from any thread, or a `weights_source`
polled at every hand-back): with interrupt="recompute" the switch happens at the next decode
step boundary, the KV of every in-flight sequence is recomputed with the new weights and
decoding goes on; with interrupt="finish" no slot is refilled until the in-flight sequences
finish on the old weights. Every token records the version whose logits it was sampled from.

The KV cache is a ring of max-length rows, one per slot, or with kv_page_size > 0 a pool of
fixed-size blocks (rollout/slots.py). Paged, the host hands blocks out between decode calls:
before each call every live slot gets the blocks its next steps_per_sync tokens need, a waiting
request is admitted only when its prompt plus its first call fit in free blocks (a group's full
prompt blocks are shared by its samples), and when the pool runs dry the youngest sequences are
preempted: their blocks freed, their tokens kept, their KV rebuilt by a prefill when they are
readmitted, ahead of new requests. The same prefill rebuilds the KV of every live sequence on an
interrupt="recompute" weight switch. Slots then bound the sequences in flight and blocks bound
their tokens, so a long-tailed workload runs many more sequences in the memory of a few
max-length rows.

Multi-turn episodes are one row each: a request with hold=True keeps its sequence when a turn
ends (Sample.session names it) and `extend(session, tokens)` appends context tokens (an
environment's observation) and queues its next turn. Paged, a held sequence gives its slot back
but keeps its blocks and the KV of its cached positions, so the next turn runs only the tokens
after them (slots.extend) instead of prefilling the whole row; held blocks are the first to go
when the pool runs dry (the oldest held first), and a weight switch frees them all (their KV is
stale). A sequence without its KV is prefilled whole when admitted, as a preempted one is, which
is all the ring layout (kv_page_size 0) ever does: KV reuse between turns needs
rollout.kv_page_size > 0. reuse_kv=False makes a paged engine do the same (its held sequences
keep their tokens, not their blocks): the baseline benchmarks/episodes.py measures reuse against.

`generate` (prompts x group_size -> Rollout, the trainer's layout) runs on submit/poll.
"""
import collections
import dataclasses
import functools
import itertools
import threading
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hex.config import check_paged_kv
from jaxrl_hex.data.rollouts import Rollout, decode_completions, encode_prompts
from jaxrl_hex.errors import UserError
from jaxrl_hex.meshes import local_device, to_host
from jaxrl_hex.models.decoder import CACHE_AXES, cache_shapes
from jaxrl_hex.models.sharding import traced_under
from jaxrl_hex.rollout import slots as S
from jaxrl_hex.rollout.pages import BlockPool

INTERRUPT_MODES = ("recompute", "finish")


@dataclasses.dataclass
class Request:
  """A prompt (text, or token ids taken as they are) to sample n completions of."""
  prompt: typing.Any
  n: int = 1
  max_tokens: int | None = None  # None: the engine's max_new_tokens
  stop: tuple = ()  # stop strings on top of the engine's
  id: typing.Any = None
  key: typing.Any = None  # PRNG key, typed or raw data: sample j draws its token c with fold_in(fold_in(key, j), c);
  # None: the engine's rng, by submission order. Turn k > 0 of a held sample draws with fold_in(fold_in(its key, k), c)
  hold: bool = False  # keep each sample's sequence when this turn ends, to continue it (Engine.extend)


@dataclasses.dataclass
class Sample:
  """One finished completion."""
  request_id: typing.Any
  index: int  # which of the request's n samples
  prompt_tokens: list
  tokens: np.ndarray  # [L] int32, through the EOS or the token that completed a stop string
  logprobs: np.ndarray  # [L] fp32 behaviour logprobs
  versions: np.ndarray  # [L] int32
  finish_reason: str  # "eos" | "stop" | "length"
  text: str = ""
  session: typing.Any = None  # a held sequence's handle for Engine.extend / Engine.drop; None unless held

  @property
  def truncated(self) -> bool:
    return self.finish_reason == "length"


@dataclasses.dataclass
class _Seq:  # a slot's sequence in flight
  request: Request
  index: int
  prompt_tokens: list
  max_tokens: int
  key: np.ndarray  # [K] uint32: the sample's key data
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  checked: int = 0  # tokens already searched for stop strings
  shard: int = 0  # paged: the data shard of its slot, whose blocks it holds
  blocks: list = dataclasses.field(default_factory=list)  # paged: its blocks, in position order
  admitted: int = 0  # admission order: the youngest are preempted first
  hold: bool = False  # kept when its turn ends
  session: int | None = None  # its id once held
  turn: int = 0  # turns sampled before this one (the key of turn k: fold_in(base_key, k))
  base_key: np.ndarray | None = None  # [K] uint32: turn 0's key
  kept: int = 0  # paged, between turns: its blocks hold the KV of row positions [0, kept); 0: none (prefill whole)

  @property
  def row(self) -> list:
    """The tokens of the sequence: all but the last are cached, the last is fed next."""
    return self.prompt_tokens + self.tokens


class Batch(typing.NamedTuple):
  """Prompt groups submitted as requests, in the trainer's layout: what assemble() needs."""
  tokens: np.ndarray  # [N, P] int32: left-padded prompts, N = prompts x group_size, prompt-major
  valid: np.ndarray  # [N, P] bool
  group_size: int
  group_ids: np.ndarray  # [prompts]

  @property
  def rows(self) -> int:
    return self.tokens.shape[0]


@functools.partial(jax.jit, static_argnums=4)
def _sample_keys(rng, counters, has_key, given, n: int):
  """[R, n] keys of R requests' samples: request i's key is given[i] where has_key[i], else
  fold_in(rng, counters[i]); its sample j's is fold_in(that key, j). One call for a whole submit:
  a dispatch per request cost ~0.1 ms, 2% of a short rollout."""

  def samples(counter, has, key):  # key: key data
    drawn = jax.random.key_data(jax.random.fold_in(rng, counter))
    key = jax.random.wrap_key_data(jnp.where(has, key, drawn), impl=jax.random.key_impl(rng))
    return jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(n))

  return jax.vmap(samples)(counters, has_key, given)


@jax.jit
def _turn_key(key_data, turn):
  return jax.random.fold_in(jax.random.wrap_key_data(key_data), turn)


@jax.jit
def _group_keys(rng, group_ids):
  return jax.vmap(lambda g: jax.random.fold_in(rng, g))(group_ids)


def pow2_bucket(n: int, least: int = 1) -> int:
  return max(least, 1 << max(n - 1, 0).bit_length())


def engine_options(rollout_cfg) -> dict:
  """The Engine keyword arguments held in config.rollout."""
  r = rollout_cfg
  return dict(min_p=r.min_p, slots=r.slots or r.prompts_per_step * r.group_size, max_prompt_len=r.max_prompt_len,
              eos_ids=tuple(r.eos_ids) or None, stop=tuple(r.stop), interrupt=r.interrupt,
              steps_per_sync=r.steps_per_sync, memory_budget_gb=r.memory_budget_gb, kv_page_size=r.kv_page_size,
              kv_blocks=r.kv_blocks)


class Engine:
  """Generates completions on one pool. Never imports the trainer: weights arrive by load_weights."""

  def __init__(self, policy, pool, tokenizer, max_new_tokens: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, *,
               slots=256, max_prompt_len=64, eos_ids=None, stop=(), interrupt="recompute", steps_per_sync=16,
               memory_budget_gb=0.0, kv_page_size=0, kv_blocks=0, weights_source=None, cache_dtype=None, reuse_kv=True):
    self.policy, self.pool, self.tokenizer = policy, pool, tokenizer
    self.max_new_tokens, self.max_prompt_len = int(max_new_tokens), int(max_prompt_len)
    self.sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), min_p=float(min_p))
    self.eos_ids = tuple(int(i) for i in (eos_ids if eos_ids is not None else (tokenizer.eos_id,)))
    self.stop = tuple(stop)
    if interrupt not in INTERRUPT_MODES:
      raise UserError(f"rollout.interrupt={interrupt!r}; use one of {INTERRUPT_MODES}")
    self.interrupt, self.steps_per_sync = interrupt, int(steps_per_sync)
    self.weights_source = weights_source
    self.num_slots = int(slots)
    if self.num_slots < 1 or self.num_slots % pool.batch_ways:
      raise UserError(f"rollout.slots={slots} must be a positive multiple of pool '{pool.name}' batch axes "
                      f"({pool.batch_ways} ways)")
    # a sequence spans at most max_prompt_len - 1 cached prompt tokens + max_new_tokens ring columns
    self.length = self.max_prompt_len + self.max_new_tokens
    self.layout = self._layout(int(kv_page_size), int(kv_blocks), pool.batch_ways)
    self.paged = bool(self.layout.page)
    self.reuse_kv = bool(reuse_kv)  # paged: a held sequence keeps its KV when its turn ends (False: prefilled whole)
    self.blocks = BlockPool(self.layout.blocks, self.layout.shards) if self.paged else None
    self.cache_dtype = jnp.dtype(cache_dtype or policy.cfg.dtype)
    self.param_shardings = pool.shardings_for(policy.logical_axes(), policy.shapes())
    self._state_shardings = S.state_shardings(pool, policy.cfg, self.layout)
    self.memory = self._memory_plan(float(memory_budget_gb))
    # paged: a decode call copies its rows' blocks once into a contiguous cache (as fast as the ring)
    # where the budget has room for that copy, else every step gathers them layer by layer
    self.paged_copy = self.paged and self.memory["paged_decode"] == "copy"
    self.version, self.params = -1, None
    self.compile_count, self.compile_seconds = 0, 0.0
    self.decode_steps = 0  # decode steps run (each over all slots)
    self.decode_seconds = 0.0  # wall time of those steps' programs, their outputs on the host (no prefill)
    self.tokens_generated = 0
    self.preemptions = 0  # paged: sequences whose blocks were taken back mid-generation
    self.prefill_tokens = 0  # row tokens run by prefill and extend programs (padding excluded)
    self.held_evictions = 0  # paged: held sequences whose KV was freed for others (prefilled whole on extend)
    self.rng = jax.random.key(0)  # keys of requests submitted without one
    self._submitted = 0
    self._fns = {}
    self._lock = threading.Lock()
    self._busy = False  # poll() is running (it alone touches the device state)
    self._incoming = None  # (version, params) waiting for a step boundary
    self._queue = collections.deque()
    self._held = {}  # session -> _Seq waiting for extend(), the oldest held first
    self._sessions = itertools.count()
    self._seqs = [None] * self.num_slots  # slot -> _Seq in flight
    self._live = np.zeros(self.num_slots, bool)
    self._finished = []
    self._state = None
    self._t = 0  # the ring column the next decode step writes (state.kv.t)
    self._admissions = 0
    if self.paged:  # the block tables, host-owned: out-of-range ids mark blocks not held
      self._table = np.full((self.num_slots, self.layout.table_width), self.layout.blocks, np.int32)
    self.greedy = False  # sample at temperature 0 (argmax)

  def _layout(self, page: int, blocks: int, shards: int) -> S.Layout:
    """The cache layout of the kv_page_size and kv_blocks knobs; refuses knobs that cannot work."""
    check_paged_kv(page, blocks)
    cfg = self.policy.cfg
    shape = cache_shapes(cfg, self.num_slots, self.length)[0][0]
    one_head = self.pool.sharding(CACHE_AXES[0], shape, "KV cache").shard_shape(shape)[1] == 1
    flat = one_head and not cfg.scan_layers  # (models.decoder.FLAT_CACHE_AXES)
    if not page:
      return S.Layout(self.num_slots, self.length, shards=shards, flat=flat)
    per_seq = -(-self.length // page)
    blocks = blocks or self.num_slots * per_seq
    if blocks % shards or blocks // shards < per_seq:
      raise UserError(
          f"rollout.kv_blocks={blocks} must be a multiple of pool '{self.pool.name}' batch axes ({shards} ways) "
          f"and give each of them at least one longest sequence: rollout.max_prompt_len + rollout.max_new_tokens = "
          f"{self.length} tokens = {per_seq} blocks of rollout.kv_page_size={page}; use kv_blocks >= "
          f"{shards * per_seq}, a multiple of {shards}")
    return S.Layout(self.num_slots, self.length, page, blocks, shards, flat)

  def _memory_plan(self, budget_gb: float) -> dict:
    """Per-device bytes of the KV cache and the weights; refuses a cache that does not fit."""
    cfg = self.policy.cfg
    shard_bytes = lambda sharding, shape, dtype: int(np.prod(sharding.shard_shape(shape))) * jnp.dtype(dtype).itemsize
    cache = sum(
        shard_bytes(sharding, shape, self.cache_dtype) for entry, shapes in zip(
            self._state_shardings.cache, cache_shapes(cfg, *self.layout.cache_rows, self.layout.flat))
        for sharding, shape in zip(entry, shapes))
    params = sum(
        shard_bytes(sh, x.shape, x.dtype)
        for sh, x in zip(jax.tree.leaves(self.param_shardings), jax.tree.leaves(self.policy.shapes())))
    budget = int(budget_gb * 2**30) or int((local_device(self.pool).memory_stats() or {}).get("bytes_limit", 0))
    total = S.cache_bytes(cfg, *self.layout.cache_rows, self.cache_dtype)
    plan = {
        "kv_cache_bytes": total,
        "kv_cache_bytes_per_device": cache,
        "params_bytes_per_device": params,
        "budget_bytes_per_device": budget
    }
    if self.paged:  # a decode call's copy of every slot's blocks at full width, split as the pool is
      copy = S.cache_bytes(cfg, self.num_slots, self._width + self.steps_per_sync, self.cache_dtype) * cache // total
      plan["decode_copy_bytes_per_device"] = copy
      plan["paged_decode"] = "copy" if not budget or cache + params + copy <= budget else "gather"
    if budget and cache + params > budget:
      gib = lambda b: f"{b / 2 ** 30:.2f} GiB"
      what, knobs = ((f"KV pool of {self.layout.blocks} blocks x {self.layout.page} tokens",
                      "rollout.kv_blocks") if self.paged else
                     (f"KV cache for {self.num_slots} slots x {self.length} tokens",
                      "rollout.slots, rollout.max_prompt_len or rollout.max_new_tokens"))
      raise UserError(f"rollout: the {what} needs {gib(cache)} per device (+ {gib(params)} of weights) but the budget "
                      f"is {gib(budget)} (rollout.memory_budget_gb); lower {knobs}, or shard the rollout pool wider")
    return plan

  # ---- weights ------------------------------------------------------------------------------
  def load_weights(self, version: int, params):
    """Safe from any thread: applied now when nothing is in flight, else at the next step boundary."""
    with self._lock:
      self._incoming = (version, params)
      if not self._busy and not self._live.any():
        self._apply_incoming()

  def _apply_incoming(self):  # caller holds the lock
    version, params = self._incoming
    self._incoming = None
    self.version, self.params = version, params
    for seq in self._kept_seqs():  # KV of the old weights: held sequences are prefilled whole on extend
      self._free_kv(seq)
    if self._live.any() and self.paged:  # interrupt="recompute": in-flight KV from the new weights
      self._prefill([[self._seqs[slot]] for slot in np.flatnonzero(self._live)])
    elif self._live.any():
      self._state = self._run(("recompute",), functools.partial(S.recompute, self.policy), self.params, self._state)

  def _switch_weights(self):
    """At a step boundary: take weights from the source or another thread, per the interrupt mode."""
    if self.weights_source is not None:
      fresh = self.weights_source()
      if fresh is not None:
        with self._lock:
          self._incoming = fresh
    with self._lock:
      if self._incoming is not None and (self.interrupt == "recompute" or not self._live.any()):
        self._apply_incoming()

  # ---- requests -----------------------------------------------------------------------------
  def submit(self, requests):
    """Queues requests (FIFO). Their samples come back from poll() once finished."""
    requests, rows = list(requests), []
    for r in requests:  # all checked before any is queued
      ids = list(
          r.prompt) if not isinstance(r.prompt, str) else [self.tokenizer.bos_id] + self.tokenizer.encode(r.prompt)
      if not 1 <= len(ids) <= self.max_prompt_len:
        raise UserError(f"a prompt of {len(ids)} tokens does not fit rollout.max_prompt_len={self.max_prompt_len}; "
                        "raise it (the KV cache grows with it) or shorten the prompt")
      if not 1 <= r.n <= self.num_slots:
        raise UserError(f"a request for {r.n} samples needs that many decode slots; rollout.slots={self.num_slots}")
      rows.append(ids)
    if not requests:
      return
    # requests without a key draw from the engine's rng by submission order; R and n bucketed to
    # powers of two, so submits of any size share a few programs
    r_b, n_b = pow2_bucket(len(requests)), pow2_bucket(max(r.n for r in requests))
    counters = self._submitted + np.arange(r_b, dtype=np.int32)
    self._submitted += len(requests)
    has_key = np.zeros(r_b, bool)
    given = np.zeros((r_b, S.key_words()), np.uint32)  # key data: raw keys (group_requests') cost no dispatch
    for i, r in enumerate(requests):
      if r.key is not None:
        typed = jax.dtypes.issubdtype(r.key.dtype, jax.dtypes.prng_key)
        has_key[i], given[i] = True, np.asarray(jax.random.key_data(r.key) if typed else r.key)
    keys = np.asarray(jax.random.key_data(_sample_keys(self.rng, counters, has_key, given, n_b)))  # [R, n, K]
    for r, ids, own in zip(requests, rows, keys):
      budget = self.max_new_tokens if r.max_tokens is None else min(int(r.max_tokens), self.max_new_tokens)
      self._queue.append([_Seq(r, j, ids, max(budget, 1), own[j], hold=r.hold, base_key=own[j]) for j in range(r.n)])

  def extend(self, session, tokens: list[int], max_tokens: int | None = None, id=None, stop=(), hold=True):
    """Continues a held sequence: appends `tokens` (context, not sampled: no logprobs) to its row
    and queues (FIFO, as submit does) its next turn of up to max_tokens new tokens (None: as many
    as a fresh request, max_new_tokens, or what is left of the row). A row never outgrows
    max_prompt_len + max_new_tokens. Its sample comes back from poll() as Sample(request_id=id,
    index=0, prompt_tokens=the row before this turn, tokens of this turn only); with hold it is
    held again under the same session. Paged (and reuse_kv), the turn runs only the tokens after
    the KV the sequence kept; otherwise its whole row is prefilled again."""
    with self._lock:
      seq = self._held.get(session)
      if seq is None:
        raise UserError(f"engine.extend: session {session!r} is not held (unknown, dropped, or its turn is still "
                        "queued or decoding); extend the Sample.session of a finished turn submitted with hold=True")
      row = seq.row + [int(t) for t in tokens]
      room = self.length - len(row)
      if max_tokens is not None and max_tokens < 1:
        raise UserError(f"engine.extend: max_tokens={max_tokens}; a turn samples at least one token")
      budget = min(room, self.max_new_tokens) if max_tokens is None else min(int(max_tokens), self.max_new_tokens)
      if budget < 1 or budget > room:
        raise UserError(f"engine.extend: a row of {len(row)} tokens + {max(budget, 1)} new ones does not fit "
                        f"rollout.max_prompt_len + rollout.max_new_tokens = {self.length} tokens; raise them (the KV "
                        "cache grows with them), ask for fewer tokens, or end the episode")
      del self._held[session]
      seq.request = Request(list(tokens), max_tokens=budget, stop=tuple(stop), id=id, hold=hold)
      seq.prompt_tokens, seq.tokens, seq.logprobs, seq.versions, seq.checked = row, [], [], [], 0
      seq.max_tokens, seq.hold, seq.turn = budget, hold, seq.turn + 1
      seq.key = np.asarray(jax.random.key_data(_turn_key(seq.base_key, seq.turn)))
      self._queue.append([seq])

  def drop(self, session):
    """Ends a session: a held sequence's blocks are freed now; one whose turn is queued or decoding
    is freed when it ends (its sample then has session None). Unknown or dropped: nothing."""
    with self._lock:
      seq = self._held.pop(session, None)
      if seq is not None:
        self._free_kv(seq)
        return
      for seq in itertools.chain((s for entry in self._queue for s in entry), self._seqs):
        if seq is not None and seq.session is not None and seq.session == session:
          seq.hold = False

  @property
  def held(self) -> int:
    """Sequences held between turns (waiting for extend)."""
    return len(self._held)

  @property
  def queued(self) -> int:
    """Requests (or preempted sequences) waiting for slots."""
    return len(self._queue)

  @property
  def free_slots(self) -> int:
    return self.num_slots - int(self._live.sum())

  @property
  def pending(self) -> int:
    """Requests queued or in flight."""
    waiting = {id(s.request) for entry in self._queue for s in entry}
    return len(waiting | {id(s.request) for s in self._seqs if s is not None})

  def poll(self) -> list:
    """Advances by one hand-back (at most steps_per_sync decode steps); returns the samples finished."""
    with self._lock:
      self._busy = True
    try:
      self._switch_weights()
      if self.params is None:
        raise RuntimeError("engine: no weights loaded; call load_weights(version, params) first")
      draining = self.interrupt == "finish" and self._incoming is not None
      if self.paged:
        self._reserve()
      if not draining:
        self._admit()
      if self._live.any():
        self._decode(stop_on_finish=bool(self._queue) and not draining)
    finally:
      with self._lock:
        self._busy = False
    done, self._finished = self._finished, []
    return done

  def _admit(self):
    """Takes queued entries (a request's samples, a preempted or held sequence) into free slots,
    FIFO: one prefill call for the rows cached whole, one extend call for the held sequences that
    kept their KV."""
    free = [i for i in range(self.num_slots) if self._seqs[i] is None]
    entries = []
    while self._queue:
      head = self._queue[0]
      slots = self._place_paged(head, free, idle=not entries and not self._live.any()) if self.paged else (
          free[:len(head)] if len(free) >= len(head) else None)
      if not slots:
        break
      if len(slots) == len(head):
        entry = self._queue.popleft()
      else:  # an idle paged engine splits a group its blocks cannot hold at once
        entry, head[:] = head[:len(slots)], head[len(slots):]
      for seq, slot in zip(entry, slots):
        free.remove(slot)
        self._seqs[slot] = seq
        seq.admitted, self._admissions = self._admissions, self._admissions + 1
      entries.append(entry)
    whole = [entry for entry in entries if not entry[0].kept]
    if whole:
      self._prefill(whole)
    if len(whole) < len(entries):
      self._extend([entry[0] for entry in entries if entry[0].kept])

  def _slot_shard(self, slot: int) -> int:
    return slot // (self.num_slots // self.layout.shards)

  def _blocks_needed(self, seq) -> int:
    """Blocks a sequence holds through its next decode call: positions up to those it writes."""
    pos = len(seq.row) - 1
    upto = min(pos + self.steps_per_sync, len(seq.prompt_tokens) + seq.max_tokens - 1)
    return -(-upto // self.layout.page)

  def _place_paged(self, entry, free, idle: bool):
    """Slots and blocks for the samples of an entry -> their slots (blocks now held), or None
    when they do not all fit, even with the KV of held sequences freed; an idle engine places as
    many as fit. Full blocks of the cached row are shared by the samples on one shard; each
    sample holds its own beyond them. A held sequence that kept its KV stays on its shard."""
    by_shard = collections.defaultdict(list)
    for slot in free:
      by_shard[self._slot_shard(slot)].append(slot)
    if entry[0].kept:
      return self._place_kept(entry[0], by_shard[entry[0].shard])
    shared = (len(entry[0].row) - 1) // self.layout.page
    private = self._blocks_needed(entry[0]) - shared
    while True:
      placed = []  # (shard, its slots)
      left = len(entry)
      for d in sorted(by_shard, key=lambda d: (-self._room(d), d)):
        k = min(left, len(by_shard[d]), max(0, (self._room(d) - shared) // private))
        if k:
          placed.append((d, by_shard[d][:k]))
          left -= k
        if not left:
          break
      if not left or not self._evict(set(by_shard)):
        break
    if left and not (idle and placed):
      return None
    slots, seqs = [], iter(entry)
    for d, taken in placed:
      common = self.blocks.take(d, shared)
      for i, slot in enumerate(taken):
        seq = next(seqs)
        if i:
          self.blocks.share(d, common)
        seq.shard, seq.blocks = d, common + self.blocks.take(d, private)
        self._table[slot, :len(seq.blocks)] = seq.blocks
        slots.append(slot)
    return slots

  def _place_kept(self, seq, free) -> list | None:
    """A free slot of a held sequence's shard (`free`) and the blocks its turn needs beyond those
    it kept -> [slot], or None: it waits for a slot of its shard, where its KV is."""
    need = max(0, self._blocks_needed(seq) - len(seq.blocks))
    while free and self._room(seq.shard) < need:
      if not self._evict({seq.shard}, spare=seq):
        return None
    if not free:
      return None
    seq.blocks += self.blocks.take(seq.shard, need)
    self._table[free[0], :len(seq.blocks)] = seq.blocks
    return free[:1]

  def _room(self, shard: int) -> int:
    """Free blocks of a shard less those kept back for the next call's growth of the sequences in
    flight, so an admission does not preempt them at the next hand-back (a preemption recomputes a
    whole sequence)."""
    growth = -(-self.steps_per_sync // self.layout.page)
    return self.blocks.free(shard) - growth * sum(seq is not None and self._slot_shard(s) == shard
                                                  for s, seq in enumerate(self._seqs))

  def _kept_seqs(self):
    """Sequences out of a slot whose blocks hold KV, in the order they give it up: the held ones,
    oldest first, then the queued ones from the back of the queue."""
    queued = (entry[0] for entry in reversed(self._queue))
    return [seq for seq in itertools.chain(self._held.values(), queued) if seq.kept]

  def _evict(self, shards, spare=None) -> bool:
    """Frees the KV of the first of _kept_seqs on one of these shards (but `spare`) -> whether
    there was one."""
    seq = next((s for s in self._kept_seqs() if s.shard in shards and s is not spare), None)
    if seq is None:
      return False
    self._free_kv(seq)
    self.held_evictions += 1
    return True

  def _free_kv(self, seq):
    """Lets go of a sequence's blocks (paged): it is prefilled whole when admitted."""
    if self.paged:
      self.blocks.release(seq.shard, seq.blocks)
    seq.blocks, seq.kept = [], 0

  def _reserve(self):
    """Before a decode call: every live slot's blocks for the positions the call may write; where
    a shard runs dry its youngest sequences are preempted (requeued first, KV rebuilt later)."""
    for d in range(self.layout.shards):
      live = sorted((s for s in np.flatnonzero(self._live) if self._slot_shard(s) == d),
                    key=lambda s: self._seqs[s].admitted)
      need = {s: max(0, self._blocks_needed(self._seqs[s]) - len(self._seqs[s].blocks)) for s in live}
      while sum(need.values()) > self.blocks.free(d):
        if self._evict({d}):  # held KV goes before a sequence in flight
          continue
        victim = live.pop()
        del need[victim]
        self._preempt(victim)
      for slot in live:
        seq = self._seqs[slot]
        seq.blocks += self.blocks.take(d, need[slot])
        self._table[slot, :len(seq.blocks)] = seq.blocks

  def _preempt(self, slot: int):
    seq = self._release(slot)
    self._queue.appendleft([seq])
    self.preemptions += 1

  def _release(self, slot: int, keep_kv=False):
    """Frees a slot and, unless keep_kv, a paged slot's blocks -> its sequence."""
    seq = self._seqs[slot]
    self._seqs[slot] = None
    self._live[slot] = False
    if self.paged:
      self._table[slot] = self.layout.blocks
    if keep_kv and self.paged:  # every row position but the pending last one is cached
      seq.kept = len(seq.row) - 1  # (past a stop string's cut too: a position's KV depends on the tokens up to it)
    else:
      self._free_kv(seq)
    return seq

  def _row_bucket(self, n: int) -> int:
    """Prefill width of rows of up to n tokens: prompts, a sequence's whole row, or a held one's tail."""
    return min(pow2_bucket(n, 16), pow2_bucket(self.length, 16))

  def _prefill(self, entries):
    """One prefill call: each entry's row (shared by its samples) cached into their slots."""
    rows = [entry[0].row for entry in entries]
    n_b, p_b = pow2_bucket(len(rows)), self._row_bucket(max(map(len, rows)))
    tokens = np.full((n_b, p_b), self.tokenizer.pad_id, np.int32)
    lengths = np.ones(n_b, np.int32)
    for i, ids in enumerate(rows):
      tokens[i, :len(ids)], lengths[i] = ids, len(ids)
    assigned = [(r, seq) for r, entry in enumerate(entries) for seq in entry]
    m_b = pow2_bucket(len(assigned))
    slot_ids = np.full(m_b, self.num_slots, np.int32)  # padding -> dropped
    src, max_new, count = np.zeros(m_b, np.int32), np.ones(m_b, np.int32), np.zeros(m_b, np.int32)
    keys = np.zeros((m_b, S.key_words()), np.uint32)
    slot_of = {id(seq): slot for slot, seq in enumerate(self._seqs) if seq is not None}
    for a, (r, seq) in enumerate(assigned):
      slot_ids[a], src[a], max_new[a], count[a], keys[a] = slot_of[id(seq)], r, seq.max_tokens, len(seq.tokens), seq.key
    if self._state is None:
      self._state = jax.jit(self._init_state, out_shardings=self._state_shardings)()
    self.prefill_tokens += int(lengths[:len(rows)].sum())
    if self.paged:
      fill = self._writes(n_b, p_b, m_b, assigned, lengths)
    else:
      # rewind the ring: prompts end at column max_prompt_len - 1 (a longer row later), so decode
      # reads only the columns written so far until the ring wraps. A row longer than the columns
      # before t wraps to the ring's end: the ring counts as wrapped (t + T is the same column).
      cached = int(lengths.max()) - 1
      if not self._live.any():
        self._t = max(self.max_prompt_len - 1, cached)
      elif cached > self._t:
        self._t += self.length
      fill = np.int32(self._t)
    self._state = self._run(("prefill", n_b, p_b, m_b), self._prefill_fn(), self.params, self._state, tokens, lengths,
                            slot_ids, src, max_new, keys, count, fill)
    self._live[slot_ids[:len(assigned)]] = True

  def _extend(self, seqs):
    """One extend call: each held sequence's row after the positions it kept (the last sampled
    token, then the new context) run into its blocks; rows laid out R per data shard."""
    slot_of = {id(seq): slot for slot, seq in enumerate(self._seqs) if seq is not None}
    by_shard = collections.defaultdict(list)
    for seq in seqs:
      by_shard[seq.shard].append(seq)
    r = next(b for b in self._row_buckets() if b >= max(map(len, by_shard.values())))
    n, t_b = r * self.layout.shards, self._row_bucket(max(len(seq.row) - seq.kept for seq in seqs))
    table = np.full((n, self.layout.table_width), self.layout.blocks, np.int32)
    tokens = np.full((n, t_b), self.tokenizer.pad_id, np.int32)
    lengths, start, max_new = np.zeros(n, np.int32), np.zeros(n, np.int32), np.ones(n, np.int32)
    slot_ids, keys = np.full(n, self.num_slots, np.int32), np.zeros((n, S.key_words()), np.uint32)
    for d, group in by_shard.items():
      for a, seq in enumerate(group, d * r):
        tail, slot = seq.row[seq.kept:], slot_of[id(seq)]
        table[a], tokens[a, :len(tail)], lengths[a], start[a] = self._table[slot], tail, len(tail), seq.kept
        slot_ids[a], max_new[a], keys[a] = slot, seq.max_tokens, seq.key
        seq.kept = 0  # in a slot again
    self.prefill_tokens += int(lengths.sum())
    self._state = self._run(("extend", n, t_b), functools.partial(S.extend, self.policy), self.params, self._state,
                            table, tokens, lengths, start, slot_ids, max_new, keys)
    self._live[slot_ids[lengths > 0]] = True

  def _writes(self, n_b, p_b, m_b, assigned, lengths) -> S.Writes:
    """The block copies of a paged prefill: each held block of the cached rows once (a block
    shared by samples is written by the first), per shard, padded to a size fixed by the buckets."""
    width = n_b * -(-p_b // self.layout.page) + m_b
    dest = np.full((self.layout.shards, width), self.blocks.per_shard, np.int32)
    src, blk = np.zeros_like(dest), np.zeros_like(dest)
    used, seen = [0] * self.layout.shards, set()
    for r, seq in assigned:
      for j in range(-(-(int(lengths[r]) - 1) // self.layout.page)):
        d, b = seq.shard, seq.blocks[j]
        if (d, b) not in seen:
          seen.add((d, b))
          dest[d, used[d]], src[d, used[d]], blk[d, used[d]] = b, r, j
          used[d] += 1
    return S.Writes(dest, src, blk)

  def _prefill_fn(self):
    return functools.partial(S.prefill, self.policy)

  def _decode_fn(self, span):
    """The decode program of a span; the temperature is its input (_decode_args), so greedy
    evaluation and sampled rollouts run the same program."""
    options = dict(logits_sharding=self.pool.sharding(("batch", None)), paged_copy=self.paged_copy,
                   shards=self.layout.shards)
    return functools.partial(S.decode, self.policy, self.sampling, self.eos_ids, self.steps_per_sync, span, **options)

  def _init_state(self):
    return S.init_state(self.policy.cfg, self.layout, self.cache_dtype)

  def _decode(self, stop_on_finish: bool):
    args = self._decode_args(self._live, stop_on_finish)
    if self.paged:
      live = np.flatnonzero(self._live)
      if self.paged_copy:  # the positions cached before the call; its steps' columns follow them
        end = max(len(self._seqs[s].row) - 1 for s in live) or 1  # (none cached: the narrowest span, not 0)
      else:  # every position its steps reach
        end = max(self._blocks_needed(self._seqs[s]) for s in live) * self.layout.page
      span = self._span(end)
      table = jax.device_put(self._table, self._state_shardings.kv.table)
      self._state = dataclasses.replace(self._state, kv=dataclasses.replace(self._state.kv, table=table))
    else:
      span = self._span(self._t + self.steps_per_sync)
    span, rows = self._call(span)
    args += () if rows is None else (rows,)
    fn = self._compile(("decode", span, len(args[-1]) if len(args) > 3 else self.num_slots), self._decode_fn(span),
                       self.params, self._state, *args, host_outputs=True)
    t0 = time.perf_counter()
    self._state, out = fn(self.params, self._state, *args)
    out = to_host(out)
    self.decode_seconds += time.perf_counter() - t0
    steps = int(out.steps)
    self.decode_steps += steps
    self.tokens_generated += int(out.emitted[:steps].sum())
    self._t += steps
    for slot in np.flatnonzero(self._live):
      seq = self._seqs[slot]
      new = out.emitted[:steps, slot]
      seq.tokens.extend(out.tokens[:steps, slot][new].tolist())
      seq.logprobs.extend(out.logprobs[:steps, slot][new].tolist())
      seq.versions.extend([self.version] * int(new.sum()))
      reason = None if out.live[slot] else ("eos" if seq.tokens[-1] in self.eos_ids else "length")
      stop_at = self._stop_index(seq)
      if stop_at is not None:
        reason = "stop"
        del seq.tokens[stop_at:], seq.logprobs[stop_at:], seq.versions[stop_at:]
      if reason is not None:
        self._finish(slot, reason)

  def _rows(self):
    """The slots a decode call runs on (slots.decode's rows): each data shard's live slots,
    padded with its idle ones to the most any shard has live, bucketed (_row_buckets); None
    when that is all of them."""
    per = self.num_slots // self.layout.shards
    live = self._live.reshape(self.layout.shards, per)
    r = next(b for b in self._row_buckets() if b >= live.sum(1).max())
    if r == per:
      return None
    # a stable sort puts each shard's live slots first, in slot order, then its idle ones
    order = np.argsort(~live, axis=1, kind="stable")[:, :r]
    return (order + per * np.arange(self.layout.shards)[:, None]).reshape(-1).astype(np.int32)

  def _call(self, span: int) -> tuple:
    """(span, rows) of a decode call whose steps need `span` columns. Where its live slots take
    fewer slots than all (_rows), a paged call runs on them at its span, and a ring's on them at
    the ring's whole width where that reads fewer cache columns than all slots at the span (a
    long tail, a few prompts on many slots), else on all slots. A ring thus compiles a program per
    span on all slots and one per row bucket at its width, not one per pair of them: half the
    programs, as fast as those pairs (benchmarks/batch_tail.py)."""
    rows = self._rows()
    if rows is None or self.paged:
      return span, rows
    if len(rows) * self._width < self.num_slots * span:
      return self._width, rows
    return span, None

  def _row_buckets(self) -> list:
    """Slots per data shard a decode call may run on: powers of two from an eighth of the shard's
    slots (a few programs, compiled once each), and all of them."""
    per = self.num_slots // self.layout.shards
    return sorted({min(per, pow2_bucket(n, max(1, per // 8))) for n in range(1, per + 1)})

  def _span(self, end: int) -> int:
    """Cache columns a decode call attends to, when its last step writes ring column end - 1, or
    when its paged slots have cached positions below end (its steps attend to those and to the
    columns they write): a quarter of the width at a time (few compiles); a ring's whole width
    once it has wrapped; a paged slot's columns are its positions, in whole blocks (a quarter
    rounded down: rounded up, a table of 6 blocks would step by 2). Attention reads the cache it
    spans, so a fresh batch's first steps cost what its short sequences need."""
    unit, width = self.layout.page or 1, self._width
    quarter = max(unit, width // (4 * unit) * unit) if self.paged else -(-width // 4)
    return width if end > width else min(width, -(-end // quarter) * quarter)

  @property
  def _width(self) -> int:
    """Cache columns a slot can attend to: the ring, or its table's blocks."""
    return self.layout.table_width * self.layout.page if self.paged else self.length

  def _stop_index(self, seq):
    """Token count through the token that completes a stop string (strings may span tokens).
    One decode of the whole completion per hand-back; the prefix walk only runs on a hit."""
    stops = self.stop + tuple(seq.request.stop)
    checked, seq.checked = seq.checked, len(seq.tokens)
    if not stops or not any(s in self.tokenizer.decode(seq.tokens) for s in stops):
      return None
    for k in range(checked + 1, len(seq.tokens) + 1):
      text = self.tokenizer.decode(seq.tokens[:k])
      if any(s in text for s in stops):
        return k
    return None

  def _finish(self, slot, reason):
    seq = self._release(slot, keep_kv=self._seqs[slot].hold and self.reuse_kv)
    if seq.hold:
      seq.session = next(self._sessions) if seq.session is None else seq.session
      self._held[seq.session] = seq
    tokens = np.asarray(seq.tokens, np.int32)
    self._finished.append(
        Sample(seq.request.id, seq.index, seq.prompt_tokens, tokens, np.asarray(seq.logprobs, np.float32),
               np.asarray(seq.versions, np.int32), reason, self.tokenizer.decode(tokens),
               seq.session if seq.hold else None))

  # ---- the batch interface the orchestrator uses ------------------------------------------------
  def encode_prompts(self, prompts: list[str], group_size: int):
    """Strings -> left-padded [len(prompts) * group_size, P] tokens and validity (the trainer's layout)."""
    ids, tokens, valid = encode_prompts(self.tokenizer, prompts)
    return np.repeat(tokens, group_size, 0), np.repeat(valid, group_size, 0), ids

  def group_requests(self, prompts: list[str], group_size: int, rng, group_ids=None):
    """A batch of prompt groups -> (one Request per prompt: id its position, key fold_in(rng, its
    group id), so a group's samples do not depend on what else runs beside it; Batch, to
    assemble the Rollout from their samples)."""
    tokens, valid, ids = self.encode_prompts(prompts, group_size)
    group_ids = np.arange(len(prompts)) if group_ids is None else np.asarray(group_ids)
    keys = np.asarray(jax.random.key_data(_group_keys(rng, group_ids)))  # raw key data: no dispatch per request
    requests = [Request(row, n=group_size, id=i, key=keys[i]) for i, row in enumerate(ids)]
    return requests, Batch(tokens, valid, group_size, group_ids)

  def generate(self, prompts: list[str], group_size: int, rng, greedy=False, group_ids=None) -> Rollout:
    """group_size samples of each prompt, continuously batched; rows are prompt-major."""
    if self._queue or self._live.any():
      raise RuntimeError("engine: generate() needs an idle engine; drain submit()/poll() first")
    requests, batch = self.group_requests(prompts, group_size, rng, group_ids)
    self.greedy = greedy
    try:
      self.submit(requests)
      samples = []
      while len(samples) < batch.rows:
        samples += self.poll()
    finally:
      self.greedy = False
    return self.assemble(batch, samples)

  def assemble(self, batch, samples: list) -> Rollout:
    """The Rollout (prompt-major rows) of a Batch from its samples (request id = prompt position)."""
    tokens, valid, group_size = batch.tokens, batch.valid, batch.group_size
    n, c_len = tokens.shape[0], self.max_new_tokens
    completion = np.zeros((n, c_len), np.int32)
    mask = np.zeros((n, c_len), bool)
    logprobs = np.zeros((n, c_len), np.float32)
    versions = np.full((n, c_len), -1, np.int32)
    truncated = np.zeros(n, bool)
    for s in samples:
      row, k = s.request_id * group_size + s.index, len(s.tokens)
      completion[row, :k], mask[row, :k], logprobs[row, :k], versions[row, :k] = s.tokens, True, s.logprobs, s.versions
      truncated[row] = s.truncated
    return Rollout(tokens, valid, completion, mask, logprobs, versions, np.repeat(batch.group_ids, group_size),
                   truncated=truncated)

  def decode(self, rollout: Rollout) -> list[str]:
    return decode_completions(self.tokenizer, rollout)

  # ---- compiled programs ----------------------------------------------------------------------
  def warmup(self, prompt_lengths, group_size: int, turn_lengths=()) -> float:
    """Compiles now, before any weights arrive, every program a stream of group_size-sample
    requests with prompts of these token lengths runs: each prefill bucket of up to
    num_slots // group_size prompts at a time, each decode span, the ring's recompute, and with
    turn_lengths (the context tokens of extend() calls) a paged engine's extend programs. A
    replica that compiled mid-run would stall its share of the fleet for seconds. A paged
    engine's prefills of whole sequences (preempted or evicted ones readmitted, a weight switch)
    have too many buckets to compile ahead; they compile when first run. -> seconds spent."""
    t0 = time.perf_counter()
    params, state = self._abstract_state()
    i32 = lambda *shape: np.zeros(shape, np.int32)
    p_bs = sorted({self._row_bucket(n) for n in prompt_lengths if 1 <= n <= self.max_prompt_len})
    for n in range(1, max(1, self.num_slots // group_size) + 1):
      n_b, m_b = pow2_bucket(n), pow2_bucket(n * group_size)
      for p_b in p_bs:
        fill = self._writes(n_b, p_b, m_b, [], None) if self.paged else np.int32(0)
        self._compile(("prefill", n_b, p_b, m_b), self._prefill_fn(), params, state, i32(n_b, p_b), i32(n_b), i32(m_b),
                      i32(m_b), i32(m_b), np.zeros((m_b, S.key_words()), np.uint32), i32(m_b), fill)
    if self.paged:
      unit = self.layout.page
      spans = sorted({self._span(end) for end in range(unit, self._width + 1, unit)})
    else:
      first = self.max_prompt_len - 1 + self.steps_per_sync  # a call's last column, at the earliest (rewound ring)
      spans = sorted({self._span(end) for end in range(first, self.length + 2)})
    buckets = self._row_buckets()
    for span in spans:
      for r in buckets if self.paged or span == self._width else buckets[-1:]:  # (_call)
        rows = () if r == buckets[-1] else (np.zeros(r * self.layout.shards, np.int32),)
        self._compile(("decode", span, len(rows[0]) if rows else self.num_slots), self._decode_fn(span), params, state,
                      *self._decode_args(), *rows, host_outputs=True)
    if self.interrupt == "recompute" and not self.paged:
      self._compile(("recompute",), functools.partial(S.recompute, self.policy), params, state)
    reuse = self.paged and self.reuse_kv  # else a turn is a prefill of its whole row
    t_bs = sorted({self._row_bucket(n + 1) for n in turn_lengths}) if reuse else []  # + the pending token
    for n, t_b in itertools.product([r * self.layout.shards for r in buckets], t_bs):
      self._compile(("extend", n, t_b), functools.partial(S.extend, self.policy), params, state,
                    i32(n, self.layout.table_width), i32(n, t_b), i32(n), i32(n), i32(n), i32(n),
                    np.zeros((n, S.key_words()), np.uint32))
    return time.perf_counter() - t0

  def decode_program(self, span: int | None = None):
    """The program a hand-back runs, attending to `span` cache columns (None: all of them), and
    abstract inputs for it -> (jitted, args): jitted.lower(*args).compile() builds it without
    weights or a cache (footprint.decode_step measures its memory)."""
    params, state = self._abstract_state()
    args = (params, state, *self._decode_args())
    return self._jit(self._decode_fn(span or self._width), len(args), host_outputs=True), args

  def _decode_args(self, live=None, stop_on_finish=False):
    """(live [S], stop_on_finish, temperature): the decode program's inputs before rows."""
    temperature = 0.0 if self.greedy else self.sampling["temperature"]
    live = np.zeros(self.num_slots, bool) if live is None else live
    return live, np.bool_(stop_on_finish), np.float32(temperature)

  def _abstract_state(self):
    """(params, state) as ShapeDtypeStructs carrying their shardings on the pool."""
    place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    return (jax.tree.map(place, self.policy.shapes(), self.param_shardings),
            jax.tree.map(place, jax.eval_shape(self._init_state), self._state_shardings))

  def _jit(self, fn, n_args: int, host_outputs=False):
    """fn(params, state, *args) -> state, or (state, a record for the host, replicated) with
    host_outputs, jitted for the pool with the state donated, so the cache is updated in place."""
    replicated = self.pool.replicated()
    out = (self._state_shardings, replicated) if host_outputs else self._state_shardings
    # The model's activations take the pool's batch axes (models.sharding): a prefill's prompt rows
    # arrive replicated, and unconstrained every data shard ran all of them (W1 on 2 x 2: the
    # prefill at 0.41 of its matmul chain, ~0.8 with the rows split).
    fn = traced_under(self.pool.activation_sharding, fn)
    return jax.jit(fn, in_shardings=(self.param_shardings, self._state_shardings) + (replicated,) * (n_args - 2),
                   out_shardings=out, donate_argnums=(1,))

  def _compile(self, key, fn, params, state, *args, host_outputs=False):
    """_jit(fn) compiled once per key (timed and counted). The arguments may be abstract."""
    if key not in self._fns:
      t0 = time.perf_counter()
      self._fns[key] = self._jit(fn, 2 + len(args), host_outputs).lower(params, state, *args).compile()
      self.compile_count += 1
      self.compile_seconds += time.perf_counter() - t0
    return self._fns[key]

  def _run(self, key, fn, params, state, *args, host_outputs=False):
    return self._compile(key, fn, params, state, *args, host_outputs=host_outputs)(params, state, *args)
