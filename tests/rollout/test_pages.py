"""The paged KV cache: the same tokens and logprobs as the contiguous ring, and block accounting.

Each case runs one workload on a ring engine and a paged one (same weights, keys and slots, or
more slots over a pool of the ring's memory) and compares every sample; the trainer parity of
test_batching then holds for the paged engine too. A decode call's contiguous copy of its rows'
blocks (slots.Pages.narrow, PagedCall) is pinned down on its own.
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rollout.test_batching import CFG, assert_parity, make_engine, run

from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.decoder import map_cache, stack_layers
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.rollout import slots as S
from jaxrl_hex.rollout.engine import Request


@pytest.fixture(scope="module")
def weights(pools):
  policy = Policy.build(CFG)
  shardings = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  return policy, policy.init(0, shardings), policy.init(1, shardings)


def by_key(samples):
  return sorted(samples, key=lambda s: (s.request_id, s.index))


def assert_same(ring, paged):
  ring, paged = by_key(ring), by_key(paged)
  assert [(s.request_id, s.index) for s in ring] == [(s.request_id, s.index) for s in paged]
  for a, b in zip(ring, paged):
    assert a.tokens.tolist() == b.tokens.tolist() and a.finish_reason == b.finish_reason
    assert a.versions.tolist() == b.versions.tolist()
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)


PROMPTS = ["12+34=", "7=", "99+1=", "3+3=", "47+38=", "5="]
BUDGETS = [20, 5, 12, 17, 9, 14]


def requests(n=1, prompts=PROMPTS, budgets=BUDGETS):
  return [Request(p, n=n, max_tokens=b, id=i, key=jax.random.key(i)) for i, (p, b) in enumerate(zip(prompts, budgets))]


def both(pools, policy, params, reqs, page=4, blocks=0, paged_slots=None, greedy=False, on_poll=None, **kw):
  out = []
  for opts in (dict(kw), dict(kw, kv_page_size=page, kv_blocks=blocks, slots=paged_slots or kw.get("slots", 2))):
    engine = make_engine(pools, policy, max_new_tokens=20, **opts)
    engine.load_weights(0, params)
    engine.greedy = greedy
    out.append((engine, run(engine, reqs(), on_poll=on_poll and (lambda i, e=engine: on_poll(e, i)))))
  return out


@pytest.mark.parametrize("greedy", [True, False])
def test_paged_decoding_equals_the_ring(pools, weights, greedy):
  policy, params, _ = weights
  (_, ring), (paged, mine) = both(pools, policy, params, requests, slots=4, greedy=greedy)
  assert_same(ring, mine)
  assert paged.paged_copy and paged.memory["paged_decode"] == "copy"  # no budget: the call's copy
  assert paged.preemptions == 0 and paged.blocks.held == 0  # every block back once all finished
  if not greedy:
    assert_parity(policy, {0: params}, mine)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scan_layers"])
def test_a_budget_without_room_for_the_calls_copy_decodes_on_the_blocks(pools, weights, scan):
  policy, params, _ = weights
  if scan:  # the stacked pools are written and read at each layer in place (PagedIndex.layer)
    policy = Policy.build(model_config(**dict(CFG, scan_layers=True)))
    params = jax.device_put(stack_layers(params), pools["rollout"].shardings_for(policy.logical_axes(),
                                                                                 policy.shapes()))
  probe = make_engine(pools, policy, max_new_tokens=20, slots=4, kv_page_size=4).memory
  # room for the pool and the weights, not for a decode call's copy of every slot's blocks
  need = probe["kv_cache_bytes_per_device"] + probe["params_bytes_per_device"]
  budget = (need + probe["decode_copy_bytes_per_device"] // 2) / 2**30
  (_, ring), (paged, mine) = both(pools, policy, params, requests, slots=4, memory_budget_gb=budget)
  assert not paged.paged_copy and paged.memory["paged_decode"] == "gather"
  assert_same(ring, mine)


def test_group_samples_share_their_full_prompt_blocks(pools, weights):
  policy, params, _ = weights
  (_, ring), (paged, mine) = both(pools, policy, params, lambda: requests(n=4, prompts=["99+99+9="], budgets=[9]),
                                  slots=4, paged_slots=8, blocks=20)
  assert_same(ring, mine)
  # step by step: a group of 4 admitted on one of the 2 data shards (4 slots each)
  engine = make_engine(pools, policy, max_new_tokens=20, slots=8, kv_page_size=4, kv_blocks=32)  # none preempted
  engine.load_weights(0, params)
  engine.submit([Request("99+99+9=", n=4, max_tokens=9, key=jax.random.key(0))])
  engine._admit()
  seqs = [s for s in engine._seqs if s is not None]
  # 9 prompt tokens, 8 cached: 2 full blocks shared, and each sample's own block for positions 8-11 (its first call)
  assert {s.shard for s in seqs} == {0} and [len(s.blocks) for s in seqs] == [3] * 4
  shared = seqs[0].blocks[:2]
  assert all(s.blocks[:2] == shared for s in seqs) and len({s.blocks[2] for s in seqs}) == 4
  assert [engine.blocks.refs(0, b) for b in shared] == [4, 4]
  assert engine.blocks.held == 2 + 4
  done = []
  while engine.pending:
    done += engine.poll()
    if 0 < len(done) < 4:  # shared blocks stay held until the group's last sample ends
      assert all(engine.blocks.refs(0, b) == 4 - len(done) for b in shared)
  assert engine.blocks.held == 0 and engine.blocks.free(0) == engine.blocks.free(1) == 16


def test_a_pool_that_runs_dry_preempts_and_recomputes_without_loss(pools, weights):
  policy, params, _ = weights
  # 8 slots over 2 shards, 10 blocks of 4 per shard: 40 tokens for 4 sequences of up to 26 tokens each
  (_, ring), (paged, mine) = both(pools, policy, params, requests, slots=2, paged_slots=8, blocks=20, page=4)
  assert_same(ring, mine)
  assert paged.preemptions > 0 and paged.blocks.held == 0
  assert_parity(policy, {0: params}, mine)
  # calls ran on fewer slots than the engine's 8 (slots.decode's rows): 1 or 2 of each shard's 4
  sizes = {key[2] for key in paged._fns if key[0] == "decode"}
  assert sizes - {8} and sizes <= {2, 4, 8}


def test_a_decode_call_runs_on_the_live_slots_of_each_shard(pools, weights):
  policy, params, _ = weights
  engine = make_engine(pools, policy, max_new_tokens=20, slots=16, kv_page_size=4)
  assert engine._row_buckets() == [1, 2, 4, 8]  # per data shard: from an eighth of its 8 slots
  engine._live[[1, 6, 9]] = True
  assert engine._rows().tolist() == [1, 6, 9, 8]  # shard-major: 2 of each shard's 8, live first, then idle
  engine._live[[0, 2, 3, 4]] = True  # shard 0: 5 live of 8, all its slots
  assert engine._rows() is None


def test_a_decode_call_copies_its_rows_blocks_once_and_writes_its_steps_back():
  """4 rows over 2 data shards of 8 blocks of 4 positions: a call of 6 steps whose rows start
  mid-block and cross into other blocks; row 3 does not hold its third block, row 1 ends after
  step 3. Row r's step t writes r * 10 + t + 1000 (its keys and values) at its column."""
  page, span, steps, start = 4, 8, 6, np.array([5, 8, 3, 6])
  table = np.array([[3, 0, 5, 7], [1, 2, 4, 6], [0, 1, 2, 3], [7, 6, 8, 8]], np.int32)  # shard-local; 8: not held
  state = S.init_state(CFG, S.Layout(4, 16, page, 16, 2), jnp.float32)
  pools = [tuple(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) for x in entry) for entry in state.cache]
  state = dataclasses.replace(state, cache=pools, kv=dataclasses.replace(state.kv, table=jnp.asarray(table)),
                              pos=jnp.asarray(start, jnp.int32))
  live = np.ones((steps, 4), bool)
  live[4:, 1] = False
  call = S.Pages.narrow(state.kv, state, span, steps)

  def block_of(r, pos):  # -> the pool block of row r's position, or None
    blk = table[r, pos // page]
    return None if blk >= 8 else (r // 2) * 8 + blk

  for (keys, values), (k_pool, v_pool) in zip(call.cache, pools):  # [R, KV, hd, span + K], [R, KV, span + K, hd]
    assert keys.shape[-1] == values.shape[2] == span + steps
    for r in range(4):
      for pos in range(span):
        blk = block_of(r, pos)
        if blk is not None:  # blocks not held read clamped: masked
          np.testing.assert_array_equal(keys[r, :, :, pos], k_pool[blk, :, :, pos % page])
          np.testing.assert_array_equal(values[r, :, pos], v_pool[blk, :, pos % page])
    assert not keys[..., span:].any() and not values[:, :, span:].any()
  for t in range(steps):
    kv, mask, index, key_positions = call.kv.step(None, None, jnp.asarray(live[t]))
    cols = np.arange(span + steps)
    np.testing.assert_array_equal(mask, np.where(cols < span, cols < start[:, None], cols - span <= t))
    np.testing.assert_array_equal(key_positions, np.where(cols < span, cols, start[:, None] + cols - span))
    assert index == span + t
    mark = (jnp.arange(4) * 10 + t + 1000.0)[:, None, None]
    cache = [(k.at[:, :, :, index].set(mark), v.at[:, :, index].set(mark)) for k, v in call.cache]
    call = dataclasses.replace(call, cache=cache, kv=kv)
  done = call.kv.widen(call, state)
  assert done.kv is state.kv
  for (keys, values), (k_pool, v_pool) in zip(done.cache, pools):
    want_k, want_v = np.array(k_pool), np.array(v_pool)
    for r, t in zip(*np.nonzero(live.T)):
      blk = block_of(r, start[r] + t)
      if blk is not None:
        want_k[blk, :, :, (start[r] + t) % page] = want_v[blk, :, (start[r] + t) % page] = r * 10 + t + 1000
    np.testing.assert_array_equal(keys, want_k)
    np.testing.assert_array_equal(values, want_v)


def test_a_stacked_cache_is_copied_and_written_back_as_its_layers_are():
  """scan_layers: each pool array leads with the layer axis (the batch axis second); a call's copy
  and its write-back are its layers', stacked."""
  page, span, steps = 4, 8, 3
  table = np.array([[3, 0, 5, 7], [1, 2, 8, 8]], np.int32)  # a row per data shard; 8: not held
  state = S.init_state(CFG, S.Layout(2, 16, page, 16, 2), jnp.float32)
  state = dataclasses.replace(state, kv=dataclasses.replace(state.kv, table=jnp.asarray(table)),
                              pos=jnp.asarray([6, 7], jnp.int32))
  rng = np.random.default_rng(0)
  layers = [tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in entry) for entry in state.cache]
  stack = lambda cache: [tuple(jnp.stack(xs) for xs in zip(*cache))]
  results = []
  for cache in (layers, stack(layers)):
    full = dataclasses.replace(state, cache=cache)
    call = S.Pages.narrow(full.kv, full, span, steps)
    copied = call.cache
    for t in range(steps):  # row 1 ends after step 1
      kv, _, index, _ = call.kv.step(None, None, jnp.asarray([True, t < 2]))
      put = lambda x, axes, t=t, index=index: x.at[(slice(None),) * axes.index("length") + (index,)].set(t + 100.0)
      call = dataclasses.replace(call, cache=map_cache(put, call.cache), kv=kv)
    results.append((copied, call.kv.widen(call, full).cache))
  (copied, written), stacked = results
  assert (np.asarray(written[0][0]) == 100.0).any()  # the write-back happened
  for per_layer, whole in zip((copied, written), stacked):
    for x, y in zip(stack(per_layer)[0], whole[0]):
      np.testing.assert_array_equal(x, y)


def collectives(engine, span) -> list:
  """The collectives of the engine's decode program over `span` columns, on all its slots."""
  params, state = engine._abstract_state()
  args = (params, state, *engine._decode_args())
  text = engine._jit(engine._decode_fn(span), len(args), host_outputs=True).lower(*args).compile().as_text()
  return sorted(re.findall(r"= \S+ (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)", text))


def test_a_paged_decode_call_needs_no_collective_the_rings_does_not(pools, weights):
  """Each data shard copies its rows' blocks and writes their columns back in its own part of the
  pool: the sampler's and the loop's collectives only, as the ring's."""
  policy = weights[0]
  ring = make_engine(pools, policy, slots=8, max_new_tokens=20)
  paged = make_engine(pools, policy, slots=8, max_new_tokens=20, kv_page_size=4)
  expected = collectives(ring, ring._width)
  assert expected and set(expected) <= {"all-gather", "all-reduce"}
  assert collectives(paged, 8) == collectives(paged, paged._width) == expected
