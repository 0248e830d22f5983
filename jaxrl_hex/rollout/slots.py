"""Decode slots on device: S slots over one KV cache in one of two layouts, and the jitted steps over it.

Ring (the contiguous cache). Each slot owns one row of a [S, T] cache (T = longest prompt + most
new tokens). Decode step t writes every slot's new key/value at the same column t % T, so a
single scalar cache_index serves all slots however long each one's sequence is. A refilled
slot's prompt goes into the columns just before the current one (wrapping around), so a sequence
spans at most T consecutive ring columns and never overwrites itself. Where a key sits does not
matter to attention: RoPE is applied with the token's own position before caching, and valid
[S, T] marks the columns of the slot's current sequence. Columns also keep their token and
position, which is all a recompute with new weights needs. When no slot is live the engine
rewinds the ring (the next prompts end at a fixed column), so until it wraps the live columns
are a prefix: a decode call copies that prefix out, decodes on it, and writes it back, and
attention, whose cost is the cache it reads, reads only it. A call may run on some slots only
(the live ones, padded to a bucket: take_rows), their rows copied out and back the same way, so
slots a long tail leaves idle cost nothing.

Pages (the paged cache). The cache is a pool of B blocks of P tokens, laid out as a ring cache of
B rows x P columns (the same arrays, axes and shardings: blocks split over the batch axes like
slots, kv_heads over tensor). Slot s holds position p in block table[s, p // P] at column p % P;
the table (host-owned, models.decoder.PagedIndex) names blocks of the slot's own data shard, so
every gather and write stays on the devices that hold the slot. A decode call runs on the slots
the engine names (its live ones, padded to a bucket: take_rows); it copies their blocks of
positions [0, span) once into a contiguous cache with a column per step after them, decodes on
it as on a ring, and writes its steps' columns into their blocks once at the end
(Pages.narrow, PagedCall.widen). The host hands blocks out between calls (rollout.pages), shares a
group's full prompt blocks between its samples and rebuilds a sequence's KV (after preemption
or a weight switch) by prefilling its tokens again: the host holds every token, so the paged
state keeps none.

A slot feeds `pending` (first the last prompt token, then each sampled token) at position
`pos`; its KV is not in the cache yet. So a prefill only has to cache the tokens before it and
needs no logits, and the first decode step of a fresh slot samples its first completion token.
A paged sequence whose blocks still hold the KV of its first positions (a held multi-turn
sequence, rollout.engine) is taken into a slot by `extend`, which runs only the tokens after
them.
"""
import dataclasses
import typing

import jax
import jax.numpy as jnp

from jaxrl_hex.models.attention import Segments
from jaxrl_hex.models.decoder import (
    PagedIndex,
    cache_axes,
    cache_shapes,
    init_cache,
    is_flat,
    map_cache,
    read_blocks,
    rope_tables,
    split_shards,
    write_columns,
)
from jaxrl_hex.rollout.sampling import sample, uniforms


def _axes(*axes):  # a state field's logical axes, which state_shardings maps onto the pool's mesh
  return dataclasses.field(metadata={"axes": axes})


def _field_axes(cls) -> dict:
  return {f.name: f.metadata["axes"] for f in dataclasses.fields(cls) if "axes" in f.metadata}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Ring:
  """The contiguous layout's per-column record: S slots, each one row of a ring of T columns."""
  valid: jax.Array = _axes("batch", "length")  # [S, T] bool: the column holds a token of the slot's sequence
  col_tok: jax.Array = _axes("batch", "length")  # [S, T] int32: the column's token
  col_pos: jax.Array = _axes("batch", "length")  # [S, T] int32: its position
  t: jax.Array = _axes()  # [] int32: the ring column the next decode step writes (mod T)

  @property
  def width(self) -> int:
    return self.valid.shape[1]

  def step(self, pending, pos, live):
    """-> (the ring after this step, mask [S, T], the cache_index, key positions [S, T])."""
    del live  # a dead slot's column is outside every live sequence
    col = self.t % self.width
    valid, col_pos = self.valid.at[:, col].set(True), self.col_pos.at[:, col].set(pos)
    # key_positions: ring columns are not positions (sliding-window layers need the real distance)
    return Ring(valid, self.col_tok.at[:, col].set(pending), col_pos, self.t + 1), valid, col, col_pos

  def fill(self, cache, kv, tokens, lengths, slot_src, t):
    """Prompt rows' KV kv [n, .., Pb] into the ring columns before column t of the slots that
    take them (slot_src [S]: the row, or -1). A gather over the prompt KV and a select, not a
    scatter (XLA's scatter runs element by element on CPU). The cache's select covers two
    windows of Pb columns written in place, [t - Pb, t) (or [0, Pb) near the ring's start) and
    the ring's last Pb, which hold every prompt column however it wraps (each row caches at most
    Pb - 1); a select over the whole cache cost W5 (288 columns) 3.5-6 ms of its 19-57 ms calls."""
    n, p_len = tokens.shape
    filled = slot_src >= 0
    row = jnp.maximum(slot_src, 0)
    cached_len = lengths[row] - 1

    def prompt_index(cols):  # ring columns [C] -> (the prompt token each holds [S, C], it holds one)
      k = (cols[None] - (t - cached_len[:, None])) % self.width  # column c holds token c - (t - cached_len) mod T
      return jnp.minimum(k, p_len - 1), filled[:, None] & (k < cached_len[:, None])

    def put(dest, values, axis=1, lead=0, start=None):
      """values [.., n (lead), .., Pb (axis), ..] -> dest [.., S, .., T, ..] on the prompt columns
      among dest's columns [start, start + Pb) (None: all); lead: the batch axis (1 in a stacked
      cache, after the layer axis)."""
      k, in_prompt = prompt_index(jnp.arange(self.width) if start is None else start + jnp.arange(p_len))
      rows = (slice(None),) * lead + (row[:, None], k)
      picked = jnp.moveaxis(jnp.moveaxis(values, axis, lead + 1)[rows], lead + 1, axis)
      where = jnp.moveaxis(in_prompt.reshape((1,) * lead + in_prompt.shape + (1,) * (dest.ndim - 2 - lead)), lead + 1,
                           axis)
      if start is None:
        return jnp.where(where, picked, dest)
      old = jax.lax.dynamic_slice_in_dim(dest, start, p_len, axis)
      return jax.lax.dynamic_update_slice_in_dim(dest, jnp.where(where, picked, old), start, axis)

    def put_cache(dest, prompt, axes):
      at = dict(axis=axes.index("length"), lead=axes.index("batch"))
      if p_len > self.width // 2:  # the two windows would cover the ring: one select
        return put(dest, prompt, **at)
      first = jnp.clip(t % self.width - p_len, 0, self.width - p_len)
      return put(put(dest, prompt, **at, start=first), prompt, **at, start=self.width - p_len)

    positions = jnp.broadcast_to(jnp.arange(p_len), (n, p_len))
    in_prompt = prompt_index(jnp.arange(self.width))[1]
    return map_cache(put_cache, cache, kv), Ring(jnp.where(filled[:, None], in_prompt, self.valid),
                                                 put(self.col_tok, tokens), put(self.col_pos, positions), t)

  def take(self, cache, rows, shards):
    """(cache, ring) of the slots `rows` only: their cache rows and column records, copied."""
    pick = lambda x, axis: take_local(x, rows, axis, shards)
    cache = map_cache(lambda x, axes: pick(x, axes.index("batch")), cache)
    return cache, Ring(pick(self.valid, 0), pick(self.col_tok, 0), pick(self.col_pos, 0), self.t)

  def put(self, cache, small_cache, small, rows, shards):
    """(cache, ring) with the slots `rows` as take's copy of them (small_cache, small) left them."""
    put = lambda x, new, axis: put_local(x, rows, new, axis, shards)
    cache = map_cache(lambda x, new, axes: put(x, new, axes.index("batch")), cache, small_cache)
    ring = Ring(put(self.valid, small.valid, 0), put(self.col_tok, small.col_tok, 0),
                put(self.col_pos, small.col_pos, 0), small.t)
    return cache, ring

  def narrow(self, state, span, steps):
    """The state on ring columns [0, span) (a copy; the state itself when that is the whole ring)."""
    del steps  # a ring's steps write inside its span
    if span == self.width:
      return state
    cut = lambda x, axis: jax.lax.slice_in_dim(x, 0, span, axis=axis)
    ring = Ring(cut(self.valid, 1), cut(self.col_tok, 1), cut(self.col_pos, 1), self.t)
    return dataclasses.replace(state, cache=map_cache(lambda x, axes: cut(x, axes.index("length")), state.cache),
                               kv=ring)

  def widen(self, state, full):
    """state's (narrowed) ring columns written over full's first ones."""
    if self.width == full.kv.width:
      return state
    put = lambda dest, x, axis: jax.lax.dynamic_update_slice_in_dim(dest, x, 0, axis)
    f = full.kv
    ring = Ring(put(f.valid, self.valid, 1), put(f.col_tok, self.col_tok, 1), put(f.col_pos, self.col_pos, 1), self.t)
    return dataclasses.replace(
        state, cache=map_cache(lambda dest, x, axes: put(dest, x, axes.index("length")), full.cache, state.cache),
        kv=ring)


class Writes(typing.NamedTuple):
  """A paged prefill's block copies, per data shard [D, W]: block blk of prompt row src goes to
  the shard's block dest (dest >= blocks per shard: padding, dropped)."""
  dest: jax.Array
  src: jax.Array
  blk: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
  """The paged layout: a block table per slot over the cache's pool of blocks."""
  table: jax.Array = _axes("batch", None)  # [S, M] int32: shard-local block of positions [j P, (j + 1) P)
  page: int = dataclasses.field(default=16, metadata={"static": True})  # P: tokens per block
  shards: int = dataclasses.field(default=1, metadata={"static": True})  # D: data shards of slots and blocks

  @property
  def width(self) -> int:
    return self.table.shape[1] * self.page

  def fill(self, cache, kv, tokens, lengths, slot_src, writes: Writes):
    """Copies blocks of the prompt rows' KV kv [n, .., Pb] into the pool as `writes` says."""
    del tokens, lengths, slot_src  # the writes name every block

    def put(pool, prompt, axes):
      b_ax, l_ax = axes.index("batch"), axes.index("length")
      p_len = prompt.shape[l_ax]
      blocks = -(-p_len // self.page)
      pad = [(0, 0)] * prompt.ndim
      pad[l_ax] = (0, blocks * self.page - p_len)
      x = jnp.pad(prompt, pad)
      x = x.reshape(x.shape[:l_ax] + (blocks, self.page) + x.shape[l_ax + 1:])  # [.., n, .., blocks, P, ..]
      # the picked blocks [D, W, ..] in the pool's own layout (the batch axis now counts blocks)
      picked = jnp.moveaxis(jnp.moveaxis(x, (b_ax, l_ax), (0, 1))[writes.src, writes.blk], (0, 1), (b_ax, b_ax + 1))
      return set_per_shard(pool, writes.dest, picked, b_ax, self.shards, mode="drop")

    return map_cache(put, cache, kv), self

  def take(self, cache, rows, shards):
    """(cache, pages) of the slots `rows` only: their block tables; the pool stays (a paged
    slot's KV is wherever its table says, so nothing big moves)."""
    del shards
    return cache, dataclasses.replace(self, table=self.table[rows])

  def put(self, cache, small_cache, small, rows, shards):
    """(the call's pool, the tables): the host owns the tables, which a decode call leaves alone."""
    del cache, small, rows, shards
    return small_cache, self

  def narrow(self, state, span, steps):
    """The state of a decode call of up to `steps` steps whose rows have cached positions below
    `span` only: each row's KV of positions [0, span) gathered from its blocks once, then `steps`
    empty columns, one per step, in a contiguous cache [R, span + steps] (a copy). Every step
    writes the same column of it, in place, as a ring's step, whatever each row's position, and
    attention reads it as it lies (a step that gathered the rows' blocks instead copied their
    cache per layer). widen writes the steps' columns into the blocks.

    steps None: the call's steps read and write the blocks themselves (step), each layer's
    gathered copy living only while that layer runs; `span` then covers every position the call
    reaches. For a pool whose memory has no room for the whole call's copy (Engine.paged_copy)."""
    if steps is None:
      return dataclasses.replace(state, kv=dataclasses.replace(self, table=self.table[:, :span // self.page]))
    view = lambda pool, axes: read_blocks(pool, self.table[:, :span // self.page], axes, self.shards, extra=steps)
    call = PagedCall(self, state.pos, jnp.zeros((self.table.shape[0], steps), bool), jnp.int32(0), span)
    return dataclasses.replace(state, cache=map_cache(view, state.cache), kv=call)

  def step(self, pending, pos, live):
    """A step of a call narrowed without a copy: every layer gathers the rows' blocks and writes
    their new column (PagedIndex)."""
    del pending  # the host keeps the tokens
    keys = jnp.arange(self.width)
    mask = keys[None] <= pos[:, None]
    return self, mask, PagedIndex(self.table, pos, live, self.shards), jnp.broadcast_to(keys, mask.shape)

  def widen(self, state, full):
    return dataclasses.replace(state, kv=full.kv)  # the steps wrote the pool itself


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCall:
  """Pages through a decode call (Pages.narrow): the cache is [R, span + K], each row's KV of
  positions [0, span) cached before the call, then column span + i for the call's step i."""
  pages: Pages  # the rows' tables, through which widen writes the steps' columns back
  start: jax.Array  # [R] int32: each row's position at the call's first step
  written: jax.Array  # [R, K] bool: step i's column holds position start + i (the row was live at step i)
  t: jax.Array  # [] int32: steps run
  span: int = dataclasses.field(metadata={"static": True})

  @property
  def width(self) -> int:
    """Positions a row may reach (the rope tables' length)."""
    return self.pages.width

  def step(self, pending, pos, live):
    """-> (the call after this step, mask [R, span + K], the cache_index, key positions [R, span + K])."""
    del pending, pos  # the host keeps the tokens; a row's position is start + t
    col = jnp.arange(self.span + self.written.shape[1])
    step = col - self.span  # the step whose column it is; < 0: a position cached before the call
    mask = jnp.where(step < 0, col < self.start[:, None], step <= self.t)
    key_positions = jnp.where(step < 0, col, self.start[:, None] + step)
    call = dataclasses.replace(self, written=self.written.at[:, self.t].set(live), t=self.t + 1)
    return call, mask, self.span + self.t, key_positions

  def widen(self, state, full):
    """full's pool with the columns the live rows' steps wrote put in their blocks: one scatter
    per call, not one per step."""

    def put(pool, x, axes):
      steps = jax.lax.slice_in_dim(x, self.span, x.shape[axes.index("length")], axis=axes.index("length"))
      return write_columns(pool, steps, self.pages.table, self.start, self.written, axes, self.pages.shards)

    return dataclasses.replace(state, cache=map_cache(put, full.cache, state.cache), kv=full.kv)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """The engine's device state: S slots over a cache in the `kv` layout."""
  cache: list  # (keys, values) per layer or stacked, models.decoder's layout and axes (cache_axes)
  kv: Ring | Pages  # Ring: the cache is [S, T] rows; Pages: [blocks, P]
  pending: jax.Array = _axes("batch")  # [S] int32: the token the next step feeds (its KV not cached yet)
  pos: jax.Array = _axes("batch")  # [S] int32: pending's position
  count: jax.Array = _axes("batch")  # [S] int32: completion tokens sampled
  max_new: jax.Array = _axes("batch")  # [S] int32: the slot's token budget
  key: jax.Array = _axes("batch", None)  # [S, K] uint32: the slot's sample key (key data); its token c
  # is drawn with fold_in(key, c), so a sample does not depend on which slot or batch it runs in


class Decoded(typing.NamedTuple):
  """What a decode call hands the host; K = max_steps."""
  live: jax.Array  # [S] bool: still decoding after these steps
  tokens: jax.Array  # [K, S] int32: the token each step sampled
  logprobs: jax.Array  # [K, S] fp32: its behaviour logprob
  emitted: jax.Array  # [K, S] bool: the slot was live at that step (tokens[k, s] is one of its tokens)
  steps: jax.Array  # [] int32: steps run (rows [0, steps) of the above)


class _Loop(typing.NamedTuple):
  """The decode loop's carry: Decoded's fields around the state, flat and in this order, because
  XLA's buffer assignment follows the carry's order (another order grew the program's scratch)."""
  step: jax.Array  # [] int32: steps run, the row this step writes
  state: DecodeState
  live: jax.Array  # [S] bool
  tokens: jax.Array  # [K, S] int32
  logprobs: jax.Array  # [K, S] fp32
  emitted: jax.Array  # [K, S] bool
  flags: jax.Array  # [2] bool: (any slot live, any slot finished)


def key_words() -> int:
  """K: the words of one PRNG key's data under the default implementation (2 for threefry)."""
  return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape[-1]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the engine's KV lives: page == 0, a ring of `length` columns per slot; else a pool of
  `blocks` blocks of `page` tokens (split over `shards` data shards), `length` positions per slot.
  flat: the cache arrays in models.decoder's FLAT_CACHE_AXES (for shards that hold one KV head)."""
  slots: int
  length: int
  page: int = 0
  blocks: int = 0
  shards: int = 1
  flat: bool = False

  @property
  def cache_rows(self) -> tuple:
    """(rows, columns) of the cache arrays."""
    return (self.blocks, self.page) if self.page else (self.slots, self.length)

  @property
  def table_width(self) -> int:
    """M: blocks in a slot's table, enough for `length` positions."""
    return -(-self.length // self.page)


def init_state(cfg, layout: Layout, cache_dtype) -> DecodeState:
  zeros = lambda *shape, dt=jnp.int32: jnp.zeros(shape, dt)
  s, t = layout.slots, layout.length
  if layout.page:
    kv = Pages(jnp.full((s, layout.table_width), layout.blocks, jnp.int32), layout.page, layout.shards)
  else:
    kv = Ring(zeros(s, t, dt=bool), zeros(s, t), zeros(s, t), jnp.int32(0))
  return DecodeState(cache=init_cache(cfg, *layout.cache_rows, cache_dtype, layout.flat), kv=kv, pending=zeros(s),
                     pos=zeros(s), count=zeros(s), max_new=zeros(s), key=zeros(s, key_words(), dt=jnp.uint32))


def state_shardings(pool, cfg, layout: Layout) -> DecodeState:
  """A DecodeState of the fields' shardings on `pool`."""
  cache = [
      tuple(pool.sharding(a, shape, "KV cache") for a, shape in zip(axes, shapes))
      for axes, shapes in zip(cache_axes(cfg, layout.flat), cache_shapes(cfg, *layout.cache_rows, layout.flat))
  ]
  of = lambda cls: {k: pool.sharding(axes) for k, axes in _field_axes(cls).items()}
  kv = Pages(**of(Pages), page=layout.page, shards=layout.shards) if layout.page else Ring(**of(Ring))
  return DecodeState(cache=cache, kv=kv, **of(DecodeState))


def prefill(policy, params, state: DecodeState, tokens, lengths, slot_ids, src, max_new, keys, count,
            fill) -> DecodeState:
  """Caches token rows once and hands each to its slots (shared group prefill).

  tokens [n, Pb] right-padded rows with lengths [n]: a row's tokens but the last are cached,
  the last is its slots' pending token. Assignment a puts row src[a] into slot slot_ids[a]
  (slot_ids == S marks padding, dropped) with a budget of max_new[a] tokens, count[a] of them
  sampled already (a sequence resumed after preemption or a weight switch) and the sample key
  keys[a] [K] (key data). fill: where the KV goes, per layout (Ring.fill, Pages.fill).
  """
  n, p_len = tokens.shape
  slots = state.pos.shape[0]
  j = jnp.arange(p_len)
  positions = jnp.broadcast_to(j, (n, p_len))
  _, kv = policy.apply(params, tokens, positions, Segments.causal(j[None] < lengths[:, None], positions),
                       init_cache(policy.cfg, n, p_len, state.cache[0][0].dtype, is_flat(state.cache)), 0)
  slot_src = jnp.full((slots,), -1, jnp.int32).at[slot_ids].set(src, mode="drop")  # [S] prompt row or -1
  filled = slot_src >= 0
  row = jnp.maximum(slot_src, 0)
  cache, layout = state.kv.fill(state.cache, kv, tokens, lengths, slot_src, fill)
  per_slot = lambda dest, values: jnp.where(filled, values, dest)
  scatter = lambda x: jnp.zeros((slots,), jnp.int32).at[slot_ids].set(x, mode="drop")
  cached_len = lengths[row] - 1
  return dataclasses.replace(state, cache=cache, kv=layout, pending=per_slot(state.pending, tokens[row, cached_len]),
                             pos=per_slot(state.pos, cached_len), count=per_slot(state.count, scatter(count)),
                             max_new=per_slot(state.max_new,
                                              scatter(max_new)), key=state.key.at[slot_ids].set(keys, mode="drop"))


def extend(policy, params, state: DecodeState, table, tokens, lengths, start, slot_ids, max_new, keys) -> DecodeState:
  """Caches the uncached tail of paged sequences whose blocks already hold the KV of their
  positions [0, start) (a held sequence's next turn), attending to those blocks; nothing else
  of the row runs again.

  Row a (n = D R rows, R of each data shard in order, as PagedIndex splits them) is the tail
  tokens[a, :lengths[a]] [n, Tb] right-padded, at positions start[a] + t, through the blocks its
  table [n, M] names (the host's table row of its slot). Its last token becomes slot slot_ids[a]'s
  pending token with a budget of max_new[a] new tokens and the key keys[a] [K]. Padding rows have
  length 0 and slot_ids S (dropped). Padding columns write keys and values at positions after the
  pending one, which no step reads before writing it again.
  """
  n, t_len = tokens.shape
  width = table.shape[1] * state.kv.page
  positions = start[:, None] + jnp.arange(t_len)  # [n, Tb]
  key_positions = jnp.broadcast_to(jnp.arange(width), (n, width))
  mask = key_positions[:, None, :] <= positions[:, :, None]  # [n, Tb, M P]: cached, then causal
  index = PagedIndex(table, start, lengths > 0, state.kv.shards)
  _, cache = policy.apply(params, tokens, positions, mask, state.cache, index, key_positions=key_positions)
  last = jnp.maximum(lengths - 1, 0)
  put = lambda dest, values: dest.at[slot_ids].set(values, mode="drop")
  return dataclasses.replace(state, cache=cache, pending=put(state.pending, tokens[jnp.arange(n), last]),
                             pos=put(state.pos, start + last), count=put(state.count, jnp.zeros_like(start)),
                             max_new=put(state.max_new, max_new), key=put(state.key, keys))


PER_SLOT = ("pending", "pos", "count", "max_new", "key")  # DecodeState's [S, ...] fields


def _local(rows, n: int, shards: int):
  """Slot ids rows [R], R / D of each of the D data shards' in shard order -> [D, R / D] ids
  within their shard (of n // D slots)."""
  return rows.reshape(shards, -1) - (n // shards) * jnp.arange(shards, dtype=rows.dtype)[:, None]


def take_local(x, rows, axis: int, shards: int):
  """x's slots `rows` (shard-major, _local) along `axis`, each data shard taking its own: a
  gather XLA partitions without collectives (vmapped over the shards, as models.decoder's blocks)."""
  take = lambda part, local: jnp.take(part, local, axis=axis)
  got = jax.vmap(take, in_axes=(axis, 0), out_axes=axis)(split_shards(x, axis, shards),
                                                         _local(rows, x.shape[axis], shards))
  return got.reshape(x.shape[:axis] + rows.shape + x.shape[axis + 1:])


def set_per_shard(x, local, values, axis: int, shards: int, mode=None):
  """x with each data shard d's own entries local[d] [r] along `axis` set to values [.., D, r, ..]
  (D and r at `axis`), in place: a scatter XLA partitions without collectives (vmapped over the
  shards). mode: the scatter's, "drop" for out-of-range ids (padding)."""
  put = lambda part, ids, new: part.at[(slice(None),) * axis + (ids,)].set(new, mode=mode)
  out = jax.vmap(put, in_axes=(axis, 0, axis), out_axes=axis)(split_shards(x, axis, shards), local, values)
  return out.reshape(x.shape)


def put_local(x, rows, new, axis: int, shards: int):
  """x with its slots `rows` (as take_local's) set to new, in place, each data shard its own."""
  return set_per_shard(x, _local(rows, x.shape[axis], shards), split_shards(new, axis, shards), axis, shards)


def take_rows(state: DecodeState, rows, shards: int) -> DecodeState:
  """The state on the slots `rows` [R] only (shard-major, _local): their per-slot fields and
  their part of the layout (Ring.take, Pages.take)."""
  cache, kv = state.kv.take(state.cache, rows, shards)
  return dataclasses.replace(state, cache=cache, kv=kv, **{f: getattr(state, f)[rows] for f in PER_SLOT})


def put_rows(full: DecodeState, small: DecodeState, rows, shards: int) -> DecodeState:
  """full with take_rows(full, rows)'s part replaced by small, what a decode call made of it."""
  put = lambda f: getattr(full, f).at[rows].set(getattr(small, f))
  cache, kv = full.kv.put(full.cache, small.cache, small.kv, rows, shards)
  return dataclasses.replace(full, cache=cache, kv=kv, **{f: put(f) for f in PER_SLOT})


def decode(policy, sampling, eos_ids, max_steps, span, params, state: DecodeState, live, stop_on_finish,
           temperature=None, rows=None, logits_sharding=None, paged_copy=True, shards=1) -> tuple[DecodeState, Decoded]:
  """Up to max_steps decode steps over the slots; returns early once a slot finishes and
  `stop_on_finish` (requests are waiting for a slot), or when no slot is live.

  temperature: a runtime scalar (0: greedy), so sampled and greedy decoding share one program;
  None: sampling's own, a constant of the program.

  Attention reads the cache columns [0, span) of the layout only: ring columns, where the caller
  promises that every live column and every column these steps write lies there; or the
  positions a paged slot cached before the call (the caller promises they lie there), and then
  the columns these steps write; with paged_copy False (Pages.narrow without steps), the
  positions these steps reach. logits_sharding: rows over the batch axes, the vocabulary whole
  on each device. Drawing from vocabulary-sharded logits needs the whole row anyway (the inverse CDF's running
  sum) plus ~5 small collectives for maxima, sums and the pick; gathered once, the sampler needs
  none. live [S] bool: the slots decoding. rows [R]: the distinct slots the steps run on, every
  live one among them, shard by shard (R / D of each of the `shards` data shards', in order), so
  slots left idle by a long tail cost nothing; the outputs are still [.., S].
  """
  whole, slots = state, state.pos.shape[0]
  temperature = sampling["temperature"] if temperature is None else temperature
  if rows is not None:
    state, live = take_rows(state, rows, shards), live[rows]
  full = state  # the loop runs on a copy of the span (and a paged call's step columns), made and
  state = state.kv.narrow(state, span, max_steps if paged_copy else None)  # written back once per call
  width = state.pos.shape[0]
  eos = jnp.asarray(eos_ids, jnp.int32)
  tables = rope_tables(policy.cfg, state.kv.width)  # a slot's positions stay below the width it reads
  # every step's draws at once: a slot live at step i has sampled count + i tokens (a slot that
  # stops stays stopped within the call), so these are the uniforms each step would draw, and the
  # loop runs no RNG (XLA:CPU ran threefry as two 5-trip loops a step: over half its thunks)
  keys = jax.random.wrap_key_data(state.key)
  draws = jax.vmap(lambda i: uniforms(jax.vmap(jax.random.fold_in)(keys, state.count + i), width))(
      jnp.arange(max_steps))  # [K, S]: step i's uniform of each slot

  def body(loop):
    st, live, i = loop.state, loop.live, loop.step
    kv, mask, index, key_positions = st.kv.step(st.pending, st.pos, live)
    logits, cache = policy.apply(params, st.pending[:, None], st.pos[:, None], mask[:, None, :], st.cache, index,
                                 key_positions=key_positions, rope_tables=tables)
    logits = logits[:, -1] if logits_sharding is None else jax.lax.with_sharding_constraint(
        logits[:, -1], logits_sharding)
    token, logprob = sample(logits, draws[i], **dict(sampling, temperature=temperature))
    count = st.count + live
    finished = live & (jnp.isin(token, eos) | (count >= st.max_new))
    st = dataclasses.replace(st, cache=cache, kv=kv, pending=token, pos=st.pos + 1, count=count)
    live_next = live & ~finished
    # (any live, any finished) in one reduction: one collective per step over the batch axes
    flags = jnp.any(jnp.stack([live_next, finished]), axis=1)
    return _Loop(i + 1, st, live_next, loop.tokens.at[i].set(token), loop.logprobs.at[i].set(logprob),
                 loop.emitted.at[i].set(live), flags)

  def cond(loop):
    any_live, any_finished = loop.flags
    return (loop.step < max_steps) & any_live & ~(any_finished & stop_on_finish)

  per_step = lambda dtype: jnp.zeros((max_steps, width), dtype)
  loop = jax.lax.while_loop(
      cond, body,
      _Loop(jnp.int32(0), state, live, per_step(jnp.int32), per_step(jnp.float32), per_step(bool),
            jnp.stack([jnp.any(live), jnp.bool_(False)])))
  state = loop.state.kv.widen(loop.state, full)
  out = Decoded(loop.live, loop.tokens, loop.logprobs, loop.emitted, loop.step)
  if rows is None:
    return state, out
  spread = lambda x: jnp.zeros(x.shape[:-1] + (slots,), x.dtype).at[..., rows].set(x)
  return put_rows(whole, state, rows, shards), Decoded(*map(spread, out[:4]), out.steps)


def recompute(policy, params, state: DecodeState) -> DecodeState:
  """Rebuilds every cached key/value of a ring with `params` from the columns' tokens and
  positions (interruptible generation); sampled tokens and their logprobs stay as they were. A
  paged engine prefills its sequences' tokens again instead (the host holds them)."""
  ring = state.kv
  valid, pos = ring.valid, ring.col_pos
  slots, length = valid.shape
  # query column q sees key column k of the same sequence at an earlier or equal position
  mask = valid[:, :, None] & valid[:, None, :] & (pos[:, None, :] <= pos[:, :, None])
  empty = init_cache(policy.cfg, slots, length, state.cache[0][0].dtype, is_flat(state.cache))
  _, cache = policy.apply(params, ring.col_tok, pos, mask, empty, 0, key_positions=pos)
  return dataclasses.replace(state, cache=cache)


def cache_bytes(cfg, rows: int, length: int, dtype) -> int:
  """Bytes of a cache of rows x length tokens (slots x ring columns, or blocks x page)."""
  return 2 * cfg.n_layers * rows * length * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
