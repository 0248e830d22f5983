"""Train layout: sequences laid into rows of micro-batches, padded or packed (host side, numpy).

A batch arrives as rows of [left-padded prompt ++ completion]. The trainer runs the model on
rows of length L instead: `pack=False` puts one sequence per row as it arrives, so every loss
token lies in the last C columns and the output head runs on those alone (`head_from`);
`pack=True` packs sequences into rows first-fit decreasing under the row length, each sequence
keeping positions 0..len-1 and its own segment id, so the block-diagonal causal mask
(segment_mask) never lets attention cross sequences. Rows are grouped into micro-batches of R
rows (R divides over the data-parallel shards) for gradient accumulation, and the rows of every
micro-batch are dealt so each shard gets about the same number of real tokens.

Arrays are [M, K, R, L]: M minibatches (one optimizer update each), K micro-batches, R rows.
`slot` [N, C] maps completion token t of sequence i to its flat index in that layout, so per-token
quantities move between the [N, C] view (advantages, aggregation) and the layout (the model).

`share_prompts=True` (GRPO-style batches, where the samples of a group share one prompt) lays
rows out as completions only, and each micro-batch carries its groups' prompts once
(prompt_tokens [M, K, G, P]); the trainer runs each prompt once and lets every completion of
its group attend to the prompt's keys and values (rl.layout.shared_prompt_hidden), so prompt
tokens are computed once per group instead of once per sample. With `pack=True` too, a group's
completions are packed first-fit decreasing into rows of max(row_length, C) tokens (each row
continues one prompt), and the row count rounds up to a multiple of 4 so that batches take a few
shapes, not one per batch.
"""
import dataclasses
import heapq

import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  """The trainer puts the fields the model reads on its pool as an rl.layout.Rows."""
  tokens: np.ndarray  # [M, K, R, L] int32
  positions: np.ndarray  # [M, K, R, L] int32, restart at 0 in every sequence
  segments: np.ndarray  # [M, K, R, L] int32, 1.. per sequence within a row, 0 = padding
  seq: np.ndarray  # [M, K, R, L] int32, index of the sequence in the batch, N = padding
  slot: np.ndarray  # [N, C] int32 flat index into the layout; `size` where not a loss token
  minibatch_of: np.ndarray  # [N] int32
  real_tokens: int
  shards: int = 1  # data-parallel shards; row r of a micro-batch is on shard r // (R / shards)
  prompt_tokens: np.ndarray | None = None  # [M, K, G, P] share_prompts: each group's prompt, left-padded
  prompt_positions: np.ndarray | None = None  # [M, K, G, P]
  prompt_valid: np.ndarray | None = None  # [M, K, G, P] bool
  row_group: np.ndarray | None = None  # [M, K, R] which of the G prompts a row continues
  head_from: int = 0  # no loss token lies before this column

  @property
  def size(self) -> int:
    """Token slots the model computes."""
    return self.tokens.size + (0 if self.prompt_tokens is None else self.prompt_tokens.size)

  @property
  def shape(self):
    return self.tokens.shape

  def stats(self) -> dict:
    m, k, r, l = self.shape
    shards = self.shards
    per_shard = (self.segments > 0).reshape(m, k, shards, r // shards * l).sum(-1)
    return {
        "padding_share": 1.0 - self.real_tokens / self.size,
        "micro_batches": float(m * k),
        "pack_rows": float(m * k * r),
        "shard_imbalance": float(per_shard.max() / max(per_shard.mean(), 1e-9))
    }


def first_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
  """Bins (lists of item indices) with total length <= capacity, by first-fit decreasing."""
  order = np.argsort(-np.asarray(lengths), kind="stable")
  free = np.zeros(0, np.int64)
  bins: list[list[int]] = []
  for i in order:
    fits = np.nonzero(free >= lengths[i])[0]
    if fits.size:
      free[fits[0]] -= lengths[i]
      bins[fits[0]].append(int(i))
    else:
      free = np.append(free, capacity - lengths[i])
      bins.append([int(i)])
  return bins


def deal_rows(loads, micro_batches: int, shards: int, rows_per_shard: int):
  """Assigns rows (by load) to (micro-batch, shard) slots, largest first onto the lightest slot
  with room, so shards and micro-batches carry about equal tokens. -> [(k, d)] per row."""
  heap = [(0, k, d) for k in range(micro_batches) for d in range(shards)]
  room = {(k, d): rows_per_shard for k in range(micro_batches) for d in range(shards)}
  where = [None] * len(loads)
  for i in np.argsort(-np.asarray(loads), kind="stable"):
    load, k, d = heapq.heappop(heap)
    where[i] = (k, d)
    room[k, d] -= 1
    if room[k, d]:
      heapq.heappush(heap, (load + loads[i], k, d))
  return where


def dealt_rows(loads, micro_batches: int, shards: int, rows_per_shard: int):
  """deal_rows' slots as rows: -> [(k, the row's index in micro-batch k)] per row (shard d holds
  rows d * rows_per_shard on)."""
  used = {}
  for k, d in deal_rows(loads, micro_batches, shards, rows_per_shard):
    used[k, d] = used.get((k, d), 0) + 1
    yield k, d * rows_per_shard + used[k, d] - 1


def plan(tokens, valid, loss_mask, *, minibatches=1, shards=1, micro_batch_tokens=0, pack=False, row_length=0,
         share_prompts=False, group_ids=None) -> Layout:
  """tokens, valid [N, P + C]; loss_mask [N, C] -> Layout.

  row_length: L when packing (0 = P + C, the padded width); micro_batch_tokens: the token budget
  of one micro-batch, all shards together (0 = a minibatch is one micro-batch)."""
  n, width = tokens.shape
  c_len = loss_mask.shape[1]
  if n % minibatches:
    raise ValueError(f"batch of {n} sequences does not split into {minibatches} minibatches")
  if share_prompts:
    return _plan_shared(tokens, valid, loss_mask, group_ids, minibatches, shards, micro_batch_tokens, pack, row_length)
  lengths = valid.sum(1)
  row_len = max(int(row_length), width) if pack else width
  minibatch_of = np.repeat(np.arange(minibatches), n // minibatches).astype(np.int32)
  rows = []  # per minibatch: list of bins (sequence indices)
  for m in range(minibatches):
    members = np.nonzero(minibatch_of == m)[0]
    bins = first_fit_decreasing(lengths[members], row_len) if pack else [[i] for i in range(len(members))]
    rows.append([[int(members[i]) for i in b] for b in bins])
  most = max(len(b) for b in rows)
  if micro_batch_tokens:  # as few micro-batches as the budget allows, rows spread evenly over them
    k = -(-most // max(shards, micro_batch_tokens // row_len // shards * shards))
    r = -(-most // k // shards) * shards
  else:
    k, r = 1, -(-most // shards) * shards
  shape = (minibatches, k, r, row_len)
  out = {name: np.zeros(shape, np.int32) for name in ("tokens", "positions", "segments")}
  out["seq"] = np.full(shape, n, np.int32)
  slot = np.full((n, c_len), np.prod(shape), np.int64)
  positions_in_seq = np.cumsum(valid, 1) - 1
  rows_per_shard = r // shards
  for m, bins in enumerate(rows):
    loads = [int(lengths[b].sum()) for b in bins]
    for b, (kk, row) in zip(bins, dealt_rows(loads, k, shards, rows_per_shard)):
      if not pack:  # the row as the engine lays it out: every completion in the last c_len columns
        i = b[0]
        out["tokens"][m, kk, row] = tokens[i]
        out["positions"][m, kk, row] = np.maximum(positions_in_seq[i], 0)
        out["segments"][m, kk, row] = valid[i]
        out["seq"][m, kk, row] = np.where(valid[i], i, n)
        slot[i] = np.where(loss_mask[i],
                           np.ravel_multi_index((m, kk, row, width - c_len), shape) + np.arange(c_len), slot[i])
        continue
      start = 0
      for seg, i in enumerate(b, 1):
        length = lengths[i]
        cols = slice(start, start + length)
        out["tokens"][m, kk, row, cols] = tokens[i][valid[i]]
        out["positions"][m, kk, row, cols] = np.arange(length)
        out["segments"][m, kk, row, cols] = seg
        out["seq"][m, kk, row, cols] = i
        base = np.ravel_multi_index((m, kk, row, start), shape)
        completion_pos = positions_in_seq[i, width - c_len:]
        slot[i] = np.where(loss_mask[i], base + completion_pos, slot[i])
        start += length
  return Layout(**out, slot=slot.astype(np.int32), minibatch_of=minibatch_of, real_tokens=int(lengths.sum()),
                shards=shards, head_from=0 if pack else width - c_len)


def _plan_shared(tokens, valid, loss_mask, group_ids, minibatches, shards, micro_batch_tokens, pack,
                 row_length) -> Layout:
  n, width = tokens.shape
  c_len = loss_mask.shape[1]
  p_len = width - c_len
  groups = [np.nonzero(group_ids == g)[0] for g in dict.fromkeys(np.asarray(group_ids).tolist())]
  size = len(groups[0])
  if any(len(g) != size for g in groups) or len(groups) % minibatches:
    raise ValueError(f"share_prompts needs groups of equal size that split into {minibatches} minibatches")
  for g in groups:
    if not (tokens[g, :p_len] == tokens[g[0], :p_len]).all():
      raise ValueError(f"share_prompts: the samples of group {int(group_ids[g[0]])} have different prompts")
  per_minibatch = len(groups) // minibatches
  g_mb = max(1, micro_batch_tokens // (size * c_len)) if micro_batch_tokens else per_minibatch
  g_mb = min(g_mb, per_minibatch)
  k = -(-per_minibatch // g_mb)
  row_len = max(int(row_length), c_len) if pack else c_len
  lengths = valid[:, p_len:].sum(1)
  if (valid[:, p_len:] != (np.arange(c_len) < lengths[:, None])).any():
    raise ValueError("share_prompts: a completion's tokens must lie from its first column on, with no gap")
  rows = {}  # (m, kk) -> [(the row's prompt among the micro-batch's, its sequences)]
  for j, members in enumerate(groups):
    m, rest = divmod(j, per_minibatch)
    kk, gg = divmod(rest, g_mb)
    bins = first_fit_decreasing(lengths[members], row_len) if pack else [[q] for q in range(size)]
    rows.setdefault((m, kk), []).extend((gg, [members[b] for b in bin_]) for bin_ in bins)
  # packed rows come in multiples of 4 (and of the shards): a few distinct shapes, so a few compiles
  quantum = shards * max(1, 4 // shards) if pack else shards
  r = -(-max(len(v) for v in rows.values()) // quantum) * quantum
  shape = (minibatches, k, r, row_len)
  out = {name: np.zeros(shape, np.int32) for name in ("tokens", "positions", "segments")}
  out["seq"] = np.full(shape, n, np.int32)
  prompts = {
      name: np.zeros((minibatches, k, g_mb, p_len), dtype)
      for name, dtype in (("prompt_tokens", np.int32), ("prompt_positions", np.int32), ("prompt_valid", bool))
  }
  row_group = np.zeros((minibatches, k, r), np.int32)
  slot = np.full((n, c_len), np.prod(shape), np.int64)
  minibatch_of = np.zeros(n, np.int32)
  prompt_lens = valid[:, :p_len].sum(1)
  for j, members in enumerate(groups):
    m, rest = divmod(j, per_minibatch)
    kk, gg = divmod(rest, g_mb)
    first = members[0]
    prompts["prompt_tokens"][m, kk, gg] = tokens[first, :p_len]
    prompts["prompt_valid"][m, kk, gg] = valid[first, :p_len]
    prompts["prompt_positions"][m, kk, gg] = np.maximum(np.cumsum(valid[first, :p_len]) - 1, 0)
    minibatch_of[members] = m
  for (m, kk), laid in rows.items():
    if pack:  # rows dealt so every shard gets about the same tokens
      where = [row for _, row in dealt_rows([int(lengths[b].sum()) for _, b in laid], 1, shards, r // shards)]
    else:
      where = range(len(laid))
    for (gg, seqs), row in zip(laid, where):
      row_group[m, kk, row] = gg
      start = 0
      for seg, i in enumerate(seqs, 1):  # completions continue their prompt's positions (the row's padding too)
        cols = slice(start, start + lengths[i])
        out["tokens"][m, kk, row, cols] = tokens[i, p_len:p_len + lengths[i]]
        out["positions"][m, kk, row, start:] = prompt_lens[i] + np.arange(row_len - start)
        out["segments"][m, kk, row, cols] = seg
        out["seq"][m, kk, row, cols] = i
        slot[i] = np.where(loss_mask[i], np.ravel_multi_index((m, kk, row, start), shape) + np.arange(c_len), slot[i])
        start += lengths[i]
  real = int(lengths.sum() + sum(prompt_lens[g[0]] for g in groups))
  return Layout(**out, slot=slot.astype(np.int32), minibatch_of=minibatch_of, real_tokens=real, shards=shards,
                row_group=row_group, **prompts)
