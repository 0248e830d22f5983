"""Decode slots on device: one ring-layout KV cache shared by S slots, and the jitted steps over it.

Layout. Each slot owns one row of a [S, T] cache (T = longest prompt + most new tokens). Decode
step t writes every slot's new key/value at the same column t % T, so a single scalar
cache_index serves all slots however long each one's sequence is. A refilled slot's prompt
goes into the columns just before the current one (wrapping around), so a sequence spans at
most T consecutive ring columns and never overwrites itself. Where a key sits does not matter
to attention: RoPE is applied with the token's own position before caching, and valid [S, T]
marks the columns of the slot's current sequence. Columns also keep their token and position,
which is all a recompute with new weights needs.

Span. When no slot is live the engine rewinds the ring (the next prompts end at a fixed column),
so until it wraps the live columns are a prefix: a decode call copies that prefix out, decodes
on it, and writes it back, and attention, whose cost is the cache it reads, reads only it.

A slot feeds `pending` (first the last prompt token, then each sampled token) at position
`pos`; its KV is not in the cache yet. So a prefill only has to cache prompt[:-1] and needs no
logits, and the first decode step of a slot samples its first completion token.
"""
import dataclasses
import typing

import jax
import jax.numpy as jnp

from jaxrl_hex.models.attention import Segments
from jaxrl_hex.models.decoder import cache_axes, cache_shapes, init_cache, map_cache, rope_tables
from jaxrl_hex.rollout.sampling import sample


def _axes(*axes):  # a DecodeState field's logical axes, which state_shardings maps onto the pool's mesh
  return dataclasses.field(metadata={"axes": axes})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """The engine's device state: S slots, each one row of a ring of T columns."""
  cache: list  # (keys, values) per layer or stacked, models.decoder's layout and axes (cache_axes)
  valid: jax.Array = _axes("batch", "length")  # [S, T] bool: the column holds a token of the slot's sequence
  col_tok: jax.Array = _axes("batch", "length")  # [S, T] int32: the column's token
  col_pos: jax.Array = _axes("batch", "length")  # [S, T] int32: its position
  pending: jax.Array = _axes("batch")  # [S] int32: the token the next step feeds (its KV not cached yet)
  pos: jax.Array = _axes("batch")  # [S] int32: pending's position
  count: jax.Array = _axes("batch")  # [S] int32: completion tokens sampled
  max_new: jax.Array = _axes("batch")  # [S] int32: the slot's token budget
  key: jax.Array = _axes("batch", None)  # [S, K] uint32: the slot's sample key (key data); its token c
  # is drawn with fold_in(key, c), so a sample does not depend on which slot or batch it runs in
  t: jax.Array = _axes()  # [] int32: the ring column the next decode step writes (mod T)


_FIELD_AXES = {f.name: f.metadata["axes"] for f in dataclasses.fields(DecodeState) if "axes" in f.metadata}
RING_FIELDS = tuple(k for k, axes in _FIELD_AXES.items() if "length" in axes)  # [S, T]: one entry per ring column


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


def init_state(cfg, slots: int, length: int, cache_dtype) -> DecodeState:
  zeros = lambda *shape, dt=jnp.int32: jnp.zeros(shape, dt)
  keys = zeros(slots, key_words(), dt=jnp.uint32)
  return DecodeState(cache=init_cache(cfg, slots, length, cache_dtype), valid=zeros(slots, length, dt=bool),
                     col_tok=zeros(slots, length), col_pos=zeros(slots, length), pending=zeros(slots), pos=zeros(slots),
                     count=zeros(slots), max_new=zeros(slots), key=keys, t=jnp.int32(0))


def state_shardings(pool, cfg, slots: int, length: int) -> DecodeState:
  """A DecodeState of the fields' shardings on `pool`."""
  cache = [
      tuple(pool.sharding(a, shape, "KV cache") for a, shape in zip(axes, shapes))
      for axes, shapes in zip(cache_axes(cfg), cache_shapes(cfg, slots, length))
  ]
  return DecodeState(cache=cache, **{k: pool.sharding(axes) for k, axes in _FIELD_AXES.items()})


def prefill(policy, params, state: DecodeState, tokens, lengths, slot_ids, src, max_new, keys, t) -> DecodeState:
  """Caches prompts once and hands each to its slots (shared group prefill).

  tokens [n, Pb] right-padded prompts with lengths [n]; assignment a puts prompt src[a] into
  slot slot_ids[a] (slot_ids == S marks padding, dropped) with a budget of max_new[a] tokens
  and the sample key keys[a] [K] (key data).
  t: the ring column the next decode step writes (the engine rewinds it when no slot is live).
  The cache rows are rebuilt by a gather over the prompt KV and a select, not a scatter
  (XLA's scatter runs element by element on CPU).
  """
  n, p_len = tokens.shape
  slots, length = state.valid.shape
  j = jnp.arange(p_len)
  positions = jnp.broadcast_to(j, (n, p_len))
  _, kv = policy.apply(params, tokens, positions, Segments.causal(j[None] < lengths[:, None], positions),
                       init_cache(policy.cfg, n, p_len, state.cache[0][0].dtype), 0)
  slot_src = jnp.full((slots,), -1, jnp.int32).at[slot_ids].set(src, mode="drop")  # [S] prompt row or -1
  filled = slot_src >= 0
  row = jnp.maximum(slot_src, 0)
  cached_len = lengths[row] - 1  # prompt[:-1] goes in the cache
  # ring column c of slot s holds prompt token k = c - (t - cached_len) (mod T)
  k = (jnp.arange(length)[None] - (t - cached_len[:, None])) % length  # [S, T]
  in_prompt = filled[:, None] & (k < cached_len[:, None])
  k = jnp.minimum(k, p_len - 1)

  def put(dest, values, axis=1, lead=0):  # values [.., n (lead), .., Pb (axis), ..] -> dest [.., S, .., T, ..]
    # on the prompt columns; lead: the batch axis (1 in a stacked cache, after the layer axis)
    rows = (slice(None),) * lead + (row[:, None], k)
    picked = jnp.moveaxis(jnp.moveaxis(values, axis, lead + 1)[rows], lead + 1, axis)
    where = in_prompt.reshape((1,) * lead + in_prompt.shape + (1,) * (dest.ndim - 2 - lead))
    return jnp.where(jnp.moveaxis(where, lead + 1, axis), picked, dest)

  def per_slot(dest, values):
    return jnp.where(filled, values, dest)

  cache = map_cache(lambda dest, prompt, axes: put(dest, prompt, axes.index("length"), axes.index("batch")),
                    state.cache, kv)
  budget = jnp.zeros((slots,), jnp.int32).at[slot_ids].set(max_new, mode="drop")
  pending, pos = per_slot(state.pending, tokens[row, cached_len]), per_slot(state.pos, cached_len)
  count, max_new = per_slot(state.count, 0), per_slot(state.max_new, budget)
  return dataclasses.replace(state, cache=cache, valid=jnp.where(filled[:, None], in_prompt, state.valid),
                             col_tok=put(state.col_tok, tokens), col_pos=put(state.col_pos, positions), pending=pending,
                             pos=pos, count=count, max_new=max_new, key=state.key.at[slot_ids].set(keys,
                                                                                                   mode="drop"), t=t)


def decode(policy, sampling, eos_ids, max_steps, span, params, state: DecodeState, live, stop_on_finish,
           logits_sharding=None) -> tuple[DecodeState, Decoded]:
  """Up to max_steps decode steps over all slots; returns early once a slot finishes and
  `stop_on_finish` (requests are waiting for a slot), or when no slot is live.

  Attention reads ring columns [0, span) only: the caller promises that every live column and
  every column these steps write lies there (span = the ring length when it has wrapped).
  logits_sharding: rows over the batch axes, the vocabulary whole on each device. Drawing from
  vocabulary-sharded logits needs the whole row anyway (the inverse CDF's running sum) plus
  ~5 small collectives for maxima, sums and the pick; gathered once, the sampler needs none.
  live [S] bool: the slots decoding.
  """
  full, narrowed = state, span < state.valid.shape[1]
  if narrowed:  # the loop runs on the ring's first span columns (copied in and out once per call,
    state = _narrow(state, span)  # where every step would read the whole cache)
  slots, length = state.valid.shape
  eos = jnp.asarray(eos_ids, jnp.int32)
  tables = rope_tables(policy.cfg, length)  # a slot's positions stay below the ring's length

  def body(loop):
    st, live, i = loop.state, loop.live, loop.step
    col = st.t % length
    valid = st.valid.at[:, col].set(True)
    col_pos = st.col_pos.at[:, col].set(st.pos)
    # key_positions: ring columns are not positions (sliding-window layers need the real distance)
    logits, cache = policy.apply(params, st.pending[:, None], st.pos[:, None], valid[:, None, :], st.cache, col,
                                 key_positions=col_pos, rope_tables=tables)
    logits = logits[:, -1] if logits_sharding is None else jax.lax.with_sharding_constraint(
        logits[:, -1], logits_sharding)
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(st.key), st.count)  # [S]: token count of slot s
    token, logprob = sample(logits, keys, **sampling)
    count = st.count + live
    finished = live & (jnp.isin(token, eos) | (count >= st.max_new))
    st = dataclasses.replace(st, cache=cache, valid=valid, col_tok=st.col_tok.at[:, col].set(st.pending),
                             col_pos=col_pos, pending=token, pos=st.pos + 1, count=count, t=st.t + 1)
    live_next = live & ~finished
    # (any live, any finished) in one reduction: one collective per step over the batch axes
    flags = jnp.any(jnp.stack([live_next, finished]), axis=1)
    return _Loop(i + 1, st, live_next, loop.tokens.at[i].set(token), loop.logprobs.at[i].set(logprob),
                 loop.emitted.at[i].set(live), flags)

  def cond(loop):
    any_live, any_finished = loop.flags
    return (loop.step < max_steps) & any_live & ~(any_finished & stop_on_finish)

  rows = lambda dtype: jnp.zeros((max_steps, slots), dtype)
  loop = jax.lax.while_loop(
      cond, body,
      _Loop(jnp.int32(0), state, live, rows(jnp.int32), rows(jnp.float32), rows(bool),
            jnp.stack([jnp.any(live), jnp.bool_(False)])))
  state = _widen(loop.state, full) if narrowed else loop.state
  return state, Decoded(loop.live, loop.tokens, loop.logprobs, loop.emitted, loop.step)


def _narrow(state: DecodeState, span) -> DecodeState:
  """The state on ring columns [0, span) (a copy)."""
  cut = lambda x, axis: jax.lax.slice_in_dim(x, 0, span, axis=axis)
  return dataclasses.replace(state, cache=map_cache(lambda x, axes: cut(x, axes.index("length")), state.cache),
                             **{k: cut(getattr(state, k), 1) for k in RING_FIELDS})


def _widen(narrow: DecodeState, full: DecodeState) -> DecodeState:
  """narrow's ring columns written over full's first ones."""
  put = lambda dest, x, axis: jax.lax.dynamic_update_slice_in_dim(dest, x, 0, axis)
  return dataclasses.replace(
      narrow, cache=map_cache(lambda dest, x, axes: put(dest, x, axes.index("length")), full.cache, narrow.cache),
      **{k: put(getattr(full, k), getattr(narrow, k), 1) for k in RING_FIELDS})


def recompute(policy, params, state: DecodeState) -> DecodeState:
  """Rebuilds every cached key/value with `params` from the columns' tokens and positions
  (interruptible generation); sampled tokens and their logprobs stay as they were."""
  valid, pos = state.valid, state.col_pos
  slots, length = valid.shape
  # query column q sees key column k of the same sequence at an earlier or equal position
  mask = valid[:, :, None] & valid[:, None, :] & (pos[:, None, :] <= pos[:, :, None])
  _, cache = policy.apply(params, state.col_tok, pos, mask,
                          init_cache(policy.cfg, slots, length, state.cache[0][0].dtype), 0, key_positions=pos)
  return dataclasses.replace(state, cache=cache)


def cache_bytes(cfg, slots: int, length: int, dtype) -> int:
  return 2 * cfg.n_layers * slots * length * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
