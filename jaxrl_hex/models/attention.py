"""Blockwise attention over masks held as per-token segment ids and positions.

A packed training row, a left-padded prompt and a completion attending its group's shared prompt
all mask attention the same way: query t sees key s when both carry the same segment id > 0 (or
the key's id is SHARED: a prompt every completion packed in its row continues) and the key's
position is not after the query's (and, for sliding layers, fewer than `window` positions before
it). `Segments` holds that rule as [B, T] and [B, S] arrays, so no [B, T, S]
mask exists, and `blockwise_attention` computes attention over [block, block] tiles with an
online softmax (flash attention's algorithm, in portable JAX), so no [B, H, T, S] scores exist
either: memory grows linearly with the sequence length. Tiles no query of the batch can see
(above the causal diagonal, across packed sequences) are skipped.

The backward pass is written out (jax.custom_vjp) as flash attention's: it keeps the output and
each query's log-sum-exp, and recomputes the tiles' probabilities, so differentiating it holds
no [T, S] array either. Rows of a single tile (no longer than `block`: the trainer's short rows)
keep that tile's probabilities instead, [B, H, T, S] at most block x block per head, as dense
attention's backward does: recomputing them (a batched matmul and an exp pass) took ~12 of
~40 ms of a layer's attention forward + backward at W3's shapes on CPU.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp

NO_WINDOW = 2**30  # a window no sequence reaches
SHARED = -1  # a key segment id every query of its row with an id > 0 sees: a prompt its row's sequences share
_MASKED = -1e30  # finite, so a query that sees nothing in a tile keeps a finite running max
_EMPTY_LSE = 1e30  # a query that sees no key at all: exp(s - lse) = 0 in the backward pass


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
  """Query t sees key s iff (q_segments[t] == k_segments[s] > 0, or k_segments[s] == SHARED and
  q_segments[t] > 0) and 0 <= q_positions[t] - k_positions[s] < window."""
  q_segments: jax.Array  # [B, T] int32, 0 = padding
  q_positions: jax.Array  # [B, T] int32
  k_segments: jax.Array  # [B, S] int32, 0 = padding (or an unwritten cache slot)
  k_positions: jax.Array  # [B, S] int32
  window: jax.Array = NO_WINDOW  # int32 scalar; an array, so layers of a scan may differ
  # Static: the keys are the queries' own tokens in order (causal), which the platform kernels
  # need (models.kernels: they mask by segment id and index order).
  keys_are_queries: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @classmethod
  def causal(cls, segments, positions):
    """Keys are the queries: packed rows (ids 1.. per sequence) or padded rows (valid as ids)."""
    segments = jnp.asarray(segments).astype(jnp.int32)
    return cls(segments, positions, segments, positions, jnp.int32(NO_WINDOW), True)

  def windowed(self, window: int):
    return dataclasses.replace(self, window=jnp.int32(window))

  def dense(self):
    """The same mask as a [B, T, S] array (for the dense path and for tests)."""
    return _visible((self.q_segments, self.q_positions), (self.k_segments, self.k_positions), self.window)


def _pad_to(x, axis, size, value=0):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _blocks(x, axis, block):
  """x with `axis` cut into blocks, the block index moved to the front: [n, ..., block, ...]."""
  shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x, axis):
  """The inverse of _blocks."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _scores(q, k, visible, scale, cap):
  """q [B, KV, G, bq, hd], k [B, KV, hd, bk] -> (masked scores, capped-score tanh or None),
  fp32 [B, KV, G, bq, bk]."""
  s = jnp.einsum("bhgqd,bhdk->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
  t = None
  if cap:
    t = jnp.tanh(s / cap)
    s = t * cap
  return jnp.where(visible[:, None, None], s, _MASKED), t


def _tiles(mask: Segments, bq, bk):
  """Per query block i: its mask arrays; per key block j: its; each [n, B, block]."""
  q = [_blocks(a, 1, bq) for a in (mask.q_segments, mask.q_positions)]
  k = [_blocks(a, 1, bk) for a in (mask.k_segments, mask.k_positions)]
  return q, k


def _visible(qm, km, window):
  """(segments, positions) of queries [B, T] and keys [B, S] -> the mask [B, T, S]."""
  (qs, qp), (ks, kp) = qm, km
  qs, ks = qs[:, :, None], ks[:, None, :]
  distance = qp[:, :, None] - kp[:, None, :]
  seen = ((qs == ks) & (ks > 0)) | ((ks == SHARED) & (qs > 0))
  return seen & (distance >= 0) & (distance < window)


def _tile(qi, kj, vj, visible, scale, cap, carry):
  """The online softmax's (running max, sum, output accumulator) after one more key tile."""
  m, l, acc = carry
  s, _ = _scores(qi, kj, visible, scale, cap)
  m_new = jnp.maximum(m, s.max(-1))
  p = jnp.where(visible[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
  correction = jnp.exp(m - m_new)
  acc = acc * correction[..., None] + jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(vj.dtype), vj,
                                                 preferred_element_type=jnp.float32)
  return m_new, l * correction + p.sum(-1), acc


def _finish(qi, m, l, acc):
  """-> (out in q's dtype, lse) of a query block from its online softmax's final state."""
  seen = l > 0
  out = acc / jnp.where(seen, l, 1.0)[..., None]
  return out.astype(qi.dtype), jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), _EMPTY_LSE)


def _start(qi):
  stats = qi.shape[:-1]
  return jnp.full(stats, _MASKED, jnp.float32), jnp.zeros(stats, jnp.float32), jnp.zeros(qi.shape, jnp.float32)


def _single_tile(q, k, v, mask, scale, cap):
  """Attention over one tile -> (out in q's dtype, (probabilities [B, KV, G, T, S] fp32, the
  capped scores' tanh or None)): what its backward reads."""
  visible = mask.dense()
  s, t = _scores(q, k, visible, scale, cap)
  p = jnp.where(visible[:, None, None], jax.nn.softmax(s, axis=-1), 0.0)
  out = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.astype(q.dtype), (p, t)


def _forward(q, k, v, mask, scale, cap, bq, bk):
  """Padded, blocked inputs -> (out [B, KV, G, T, hd] in q's dtype, what the backward reads: each
  query's lse [B, KV, G, T] fp32, or for one tile its probabilities, _single_tile)."""
  if _one_tile(q, k, bq, bk):
    return _single_tile(q, k, v, mask, scale, cap)
  qm, km = _tiles(mask, bq, bk)
  kb, vb = _blocks(k, 3, bk), _blocks(v, 2, bk)  # [nk, B, KV, hd, bk], [nk, B, KV, bk, hd]

  def q_block(xs):
    qi, qmi = xs[0], xs[1:]

    def k_step(carry, ys):
      kj, vj, kmj = ys[0], ys[1], ys[2:]
      visible = _visible(qmi, kmj, mask.window)
      tile = lambda carry: _tile(qi, kj, vj, visible, scale, cap, carry)
      return jax.lax.cond(visible.any(), tile, lambda c: c, carry), None

    return _finish(qi, *jax.lax.scan(k_step, _start(qi), (kb, vb, *km))[0])

  out, lse = jax.lax.map(q_block, (_blocks(q, 3, bq), *qm))
  return _unblocks(out, 3), _unblocks(lse, 3)


def _one_tile(q, k, bq, bk):
  """Whether the (padded) queries and keys are one tile: then attention is straight-line code,
  with no loop, skip test or second backward pass (the trainer's short rows)."""
  return q.shape[3] == bq and k.shape[3] == bk


def _tile_grads(qi, kj, vj, doi, lsei, deltai, visible, scale, cap):
  """One tile's probabilities and score gradients: (p, ds), each fp32 [B, KV, G, bq, bk]."""
  s, t = _scores(qi, kj, visible, scale, cap)
  p = jnp.where(visible[:, None, None], jnp.exp(s - lsei[..., None]), 0.0)
  dp = jnp.einsum("bhgqd,bhkd->bhgqk", doi, vj, preferred_element_type=jnp.float32)
  ds = p * (dp - deltai[..., None])
  if cap:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2
    ds = ds * (1.0 - t * t)
  return p, ds * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attend(q, k, v, mask, scale, cap, bq, bk):
  return _forward(q, k, v, mask, scale, cap, bq, bk)[0]


def _attend_fwd(q, k, v, mask, scale, cap, bq, bk):
  out, stats = _forward(q, k, v, mask, scale, cap, bq, bk)
  return out, (q, k, v, mask, out, stats)


def _attend_bwd(scale, cap, bq, bk, residuals, d_out):
  q, k, v, mask, out, stats = residuals
  delta = (d_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)  # [B, KV, G, T]
  if _one_tile(q, k, bq, bk):  # one pass over the forward's probabilities
    p, t = stats
    dp = jnp.einsum("bhgqd,bhkd->bhgqk", d_out, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None])
    if cap:
      ds = ds * (1.0 - t * t)
    ds = ds * scale
    dq = jnp.einsum("bhgqk,bhdk->bhgqd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhgqk,bhgqd->bhdk", ds, q, preferred_element_type=jnp.float32)
    dv = jnp.einsum("bhgqk,bhgqd->bhkd", p, d_out, preferred_element_type=jnp.float32)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), jax.tree.map(lambda x: None, mask)
  qm, km = _tiles(mask, bq, bk)
  qb, dob, lseb, deltab = _blocks(q, 3, bq), _blocks(d_out, 3, bq), _blocks(stats, 3, bq), _blocks(delta, 3, bq)
  kb, vb = _blocks(k, 3, bk), _blocks(v, 2, bk)

  def skip_or(visible, grads, carry):
    return jax.lax.cond(visible.any(), grads, lambda c: c, carry)

  def dq_block(xs):  # one query block against every key block
    qi, doi, lsei, deltai, qmi = xs[0], xs[1], xs[2], xs[3], xs[4:]

    def k_step(dq, ys):
      kj, vj, kmj = ys[0], ys[1], ys[2:]
      visible = _visible(qmi, kmj, mask.window)

      def grads(dq):
        _, ds = _tile_grads(qi, kj, vj, doi, lsei, deltai, visible, scale, cap)
        return dq + jnp.einsum("bhgqk,bhdk->bhgqd", ds, kj, preferred_element_type=jnp.float32)

      return skip_or(visible, grads, dq), None

    dq, _ = jax.lax.scan(k_step, jnp.zeros(qi.shape, jnp.float32), (kb, vb, *km))
    return dq.astype(q.dtype)

  def dkv_block(ys):  # one key block against every query block
    kj, vj, kmj = ys[0], ys[1], ys[2:]

    def q_step(carry, xs):
      qi, doi, lsei, deltai, qmi = xs[0], xs[1], xs[2], xs[3], xs[4:]
      visible = _visible(qmi, kmj, mask.window)

      def grads(carry):
        dk, dv = carry
        p, ds = _tile_grads(qi, kj, vj, doi, lsei, deltai, visible, scale, cap)
        dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p, doi, preferred_element_type=jnp.float32)
        return dk + jnp.einsum("bhgqk,bhgqd->bhdk", ds, qi, preferred_element_type=jnp.float32), dv

      return skip_or(visible, grads, carry), None

    init = (jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32))
    (dk, dv), _ = jax.lax.scan(q_step, init, (qb, dob, lseb, deltab, *qm))
    return dk.astype(k.dtype), dv.astype(v.dtype)

  dq = _unblocks(jax.lax.map(dq_block, (qb, dob, lseb, deltab, *qm)), 3)
  dk, dv = jax.lax.map(dkv_block, (kb, vb, *km))
  mask_cotangent = jax.tree.map(lambda x: None, mask)
  return dq, _unblocks(dk, 3), _unblocks(dv, 2), mask_cotangent


_attend.defvjp(_attend_fwd, _attend_bwd)


def blockwise_attention(q, keys, values, mask: Segments, scale: float, cap: float = 0.0, block: int = 512):
  """q [B, KV, G, T, hd], keys [B, KV, hd, S], values [B, KV, S, hd] (the KV cache's layout) ->
  [B, KV, G, T, hd], attention under `mask`, computed over tiles of at most `block` queries by
  `block` keys. Queries that see no key get zeros."""
  t, s = q.shape[3], keys.shape[3]
  bq, bk = min(block, t), min(block, s)
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  mask = Segments(_pad_to(mask.q_segments, 1, tp), _pad_to(mask.q_positions, 1, tp), _pad_to(mask.k_segments, 1, sp),
                  _pad_to(mask.k_positions, 1, sp), jnp.asarray(mask.window, jnp.int32))
  # Tied to q, so the mask counts as varying with it: otherwise JAX's partial evaluation of the
  # differentiated layer scan hoists every tile's mask out of the loop as loop-invariant, all
  # [T/block, S/block, B, H, block, block] of it at once.
  q, mask = jax.lax.optimization_barrier((q, mask))
  out = _attend(_pad_to(q, 3, tp), _pad_to(keys, 3, sp), _pad_to(values, 2, sp), mask, scale, cap, bq, bk)
  return out[:, :, :, :t]
