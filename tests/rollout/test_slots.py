"""rollout.slots: the ring's prefill fill against a column-by-column reference."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hex.models.decoder import CACHE_AXES, FLAT_CACHE_AXES
from jaxrl_hex.rollout import slots as S


def reference_fill(cache, prompt, lengths, slot_src, t, axes):
  """Each filled slot's cached prompt tokens (all but the row's last) into the columns before
  ring column t, one column at a time."""
  out = np.array(cache)
  b_ax, l_ax = axes.index("batch"), axes.index("length")
  width = out.shape[l_ax]
  for s, r in enumerate(slot_src):
    if r < 0:
      continue
    n = lengths[r] - 1
    for j in range(n):
      dest, src = [slice(None)] * out.ndim, [slice(None)] * out.ndim
      dest[b_ax], dest[l_ax], src[b_ax], src[l_ax] = s, (t - n + j) % width, r, j
      out[tuple(dest)] = prompt[tuple(src)]
  return out


@pytest.mark.parametrize("width", [40, 12])  # 8-column prompts: two windows of 8 columns; one select over 12
@pytest.mark.parametrize("layout", [CACHE_AXES, FLAT_CACHE_AXES])
def test_ring_fill_writes_exactly_the_prompt_columns_wherever_the_ring_wraps(width, layout):
  rng = np.random.default_rng(0)
  slots, n, p_len = 5, 3, 8
  sizes = dict(kv_heads=2, head_dim=3)
  shape = lambda axes, batch, length: [dict(sizes, batch=batch, length=length)[a] for a in axes]
  lengths = np.array([8, 3, 1], np.int32)  # 7, 2 and 0 cached tokens
  slot_src = np.array([2, -1, 0, 1, 0], np.int32)
  ring = S.Ring(jnp.zeros((slots, width), bool), jnp.zeros((slots, width), jnp.int32),
                jnp.zeros((slots, width), jnp.int32), jnp.int32(0))
  fill = jax.jit(ring.fill)
  for t in [0, 3, 7, 8, 15, width - 1, width, width + 5, 2 * width - 2]:
    cache = [tuple(rng.standard_normal(shape(axes, slots, width)).astype(np.float32) for axes in layout)]
    prompt = [tuple(rng.standard_normal(shape(axes, n, p_len)).astype(np.float32) for axes in layout)]
    tokens = rng.integers(1, 9, (n, p_len)).astype(np.int32)
    got, ring_after = fill(cache, prompt, tokens, lengths, slot_src, np.int32(t))
    for a, b, p, axes in zip(got[0], cache[0], prompt[0], layout):
      np.testing.assert_array_equal(a, reference_fill(b, p, lengths, slot_src, t, axes))
    valid = np.asarray(ring_after.valid)
    for s, r in enumerate(slot_src):
      want = np.zeros(width, bool) if r < 0 else np.isin(np.arange(width), (t - np.arange(1, lengths[r])) % width)
      np.testing.assert_array_equal(valid[s], want)


def test_a_call_s_rows_are_taken_and_put_back_by_each_data_shard_without_collectives(pools):
  """take_local / put_local on the rollout pool (data 2 x tensor 2): slots [1, 6, 9, 8] of 16,
  two of each shard's 8, are x's rows, put back in place, and the programs move no data between
  devices (a gather across shards would all-gather the whole cache)."""
  pool = pools["rollout"]
  x = jax.device_put(jnp.arange(16 * 4 * 6.0).reshape(16, 4, 6), pool.sharding(("batch", "kv_heads", None)))
  rows = jnp.array([1, 6, 9, 8], jnp.int32)
  take = jax.jit(lambda x, r: S.take_local(x, r, 0, 2))
  put = jax.jit(lambda x, r, new: S.put_local(x, r, new, 0, 2))
  np.testing.assert_array_equal(take(x, rows), np.asarray(x)[[1, 6, 9, 8]])
  new = -jnp.ones((4, 4, 6))
  want = np.asarray(x).copy()
  want[[1, 6, 9, 8]] = -1
  np.testing.assert_array_equal(put(x, rows, new), want)
  for fn, args in ((take, (x, rows)), (put, (x, rows, new))):
    hlo = fn.lower(*args).compile().as_text()
    assert not re.search(r"all-gather|all-to-all|collective-permute|all-reduce", hlo)
