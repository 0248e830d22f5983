"""rollout.slots: the ring's prefill fill against a column-by-column reference."""
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
