import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hex.rl import packing
from jaxrl_hex.rl.layout import from_layout, to_layout


def _batch(prompt_lens, completion_lens, p=4, c=3):
  """Engine layout: left-padded prompts, right-padded completions; token ids encode (seq, offset)."""
  n = len(prompt_lens)
  tokens = np.zeros((n, p + c), np.int32)
  valid = np.zeros((n, p + c), bool)
  for i, (pl, cl) in enumerate(zip(prompt_lens, completion_lens)):
    valid[i, p - pl:p + cl] = True
    tokens[i, valid[i]] = 100 * (i + 1) + np.arange(pl + cl)
  return tokens, valid, valid[:, p:]


def test_first_fit_decreasing_hand_example():
  # sorted: 6, 5, 4, 3, 2 -> [6 | 5 3 | 4] then 2 fits the first bin
  assert packing.first_fit_decreasing([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]


def test_deal_rows_balances_tokens_across_shards():
  where = packing.deal_rows([8, 7, 2, 1], micro_batches=1, shards=2, rows_per_shard=2)
  loads = {d: sum(l for l, (_, dd) in zip([8, 7, 2, 1], where) if dd == d) for d in (0, 1)}
  assert sorted(loads.values()) == [9, 9]


def test_packed_layout_keeps_sequences_whole_with_their_own_positions():
  tokens, valid, loss_mask = _batch([2, 4, 1, 3], [3, 1, 2, 2])
  lay = packing.plan(tokens, valid, loss_mask, pack=True, row_length=8)
  assert lay.shape == (1, 1, 3, 8) and lay.real_tokens == 18
  for i in range(4):
    where = lay.seq == i
    assert where.sum() == valid[i].sum()
    np.testing.assert_array_equal(lay.tokens[where], tokens[i][valid[i]])  # in order, contiguous
    np.testing.assert_array_equal(lay.positions[where], np.arange(valid[i].sum()))
    assert len(np.unique(lay.segments[where])) == 1
  # slot: completion token t of sequence i is where its token lies in the layout
  flat = lay.tokens.reshape(-1)
  for i in range(4):
    np.testing.assert_array_equal(flat[lay.slot[i][loss_mask[i]]], tokens[i, 4:][loss_mask[i]])
    assert (lay.slot[i][~loss_mask[i]] == lay.size).all()


def test_to_and_from_layout_round_trip():
  tokens, valid, loss_mask = _batch([2, 4, 1, 3], [3, 1, 2, 2])
  lay = packing.plan(tokens, valid, loss_mask, pack=True, row_length=8)
  x = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) + 1
  back = from_layout(to_layout(x, lay.slot, lay.shape), lay.slot)
  np.testing.assert_array_equal(back, np.where(loss_mask, x, 0))


def test_micro_batches_minibatches_and_shards():
  tokens, valid, loss_mask = _batch([4] * 8, [3] * 8)
  lay = packing.plan(tokens, valid, loss_mask, minibatches=2, shards=2, micro_batch_tokens=14, pack=True, row_length=7)
  # 4 sequences of 7 tokens per minibatch, one per row; 2 rows (one per shard) per micro-batch
  assert lay.shape == (2, 2, 2, 7)
  np.testing.assert_array_equal(lay.minibatch_of, [0, 0, 0, 0, 1, 1, 1, 1])
  assert set(np.unique(lay.seq[0])) == {0, 1, 2, 3}  # full rows: no padding
  stats = lay.stats()
  assert stats["padding_share"] == 0.0 and stats["shard_imbalance"] == 1.0 and stats["micro_batches"] == 4


def test_padded_layout_is_one_sequence_per_row():
  tokens, valid, loss_mask = _batch([2, 4, 1, 3], [3, 1, 2, 2])
  lay = packing.plan(tokens, valid, loss_mask, shards=2)
  assert lay.shape == (1, 1, 4, 7)
  assert all(len(np.unique(lay.seq[0, 0, r])) <= 2 for r in range(4))  # itself and padding


def test_minibatches_must_divide_the_batch():
  tokens, valid, loss_mask = _batch([2, 4, 1], [3, 1, 2])
  with pytest.raises(ValueError, match="does not split into 2 minibatches"):
    packing.plan(tokens, valid, loss_mask, minibatches=2)


def test_shared_prompt_layout_lays_each_group_prompt_once():
  tokens, valid, loss_mask = _batch([2, 2, 3, 3], [3, 1, 2, 2])
  tokens[1, :4], tokens[3, :4] = tokens[0, :4], tokens[2, :4]
  lay = packing.plan(tokens, valid, loss_mask, share_prompts=True, group_ids=np.array([5, 5, 9, 9]), shards=2)
  assert lay.shape == (1, 1, 4, 3) and lay.prompt_tokens.shape == (1, 1, 2, 4)
  np.testing.assert_array_equal(lay.prompt_tokens[0, 0], tokens[[0, 2], :4])
  np.testing.assert_array_equal(lay.row_group[0, 0], [0, 0, 1, 1])
  np.testing.assert_array_equal(lay.positions[0, 0, 2], [3, 4, 5])  # completions continue the prompt's positions
  assert lay.real_tokens == 2 + 3 + 4 + 4  # prompts once, completions each
  flat = lay.tokens.reshape(-1)
  for i in range(4):
    np.testing.assert_array_equal(flat[lay.slot[i][loss_mask[i]]], tokens[i, 4:][loss_mask[i]])
  tokens[1, 3] += 1
  with pytest.raises(ValueError, match="group 5 have different prompts"):
    packing.plan(tokens, valid, loss_mask, share_prompts=True, group_ids=np.array([5, 5, 9, 9]))


def test_packed_shared_prompt_layout_packs_a_groups_completions_into_rows():
  tokens, valid, loss_mask = _batch([2, 2, 2, 2, 3, 3, 3, 3], [3, 1, 2, 2, 3, 3, 1, 1])
  for first in (0, 4):
    tokens[first + 1:first + 4, :4] = tokens[first, :4]
  group_ids = np.repeat([5, 9], 4)
  lay = packing.plan(tokens, valid, loss_mask, share_prompts=True, pack=True, group_ids=group_ids, shards=2)
  # group 5: [3 | 2 1] [2]; group 9: [3] [3] [1 1]: 6 rows of 3, rounded up to 8, each continuing one prompt
  assert lay.shape == (1, 1, 8, 3) and lay.prompt_tokens.shape == (1, 1, 2, 4)
  assert lay.real_tokens == 2 + 3 + 8 + 8
  for i in range(8):
    where = lay.seq == i
    np.testing.assert_array_equal(lay.tokens[where], tokens[i, 4:][loss_mask[i]])
    np.testing.assert_array_equal(lay.positions[where], (2 if i < 4 else 3) + np.arange(loss_mask[i].sum()))
    row = np.nonzero(where.any(-1)[0, 0])[0]
    assert len(row) == 1 and lay.row_group[0, 0, row[0]] == i // 4  # one row, its group's prompt
  flat = lay.tokens.reshape(-1)
  for i in range(8):
    np.testing.assert_array_equal(flat[lay.slot[i][loss_mask[i]]], tokens[i, 4:][loss_mask[i]])
  per_shard = (lay.segments[0, 0] > 0).reshape(2, 4, 3).sum((1, 2))
  assert abs(per_shard[0] - per_shard[1]) <= 1  # rows dealt by tokens
