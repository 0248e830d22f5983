"""Multi-turn sessions: a held sequence continued by extend() samples what a fresh request for its
whole row would, paged (only the new tokens run) and in the ring (the whole row runs again).

Episodes run as an agent loop would: each session is extended as soon as its turn comes back,
while other requests come and go, so continuous batching mixes turns of different sessions and
fresh prompts in the same calls.

Compiling is most of these tests' time, so the engines here have rows of 56 tokens (the fresh
prompts' reference too: its programs are the ring's; only the dry pool's differ) and the tests share
one engine per set of options (`shared`).
"""
import jax
import numpy as np
import pytest
from rollout.test_batching import CFG, TOK, assert_parity, make_engine

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.rollout.engine import Request

PROMPTS = ["12+34=", "7=", "99+1="]  # one episode each; the second samples a group of 2 (shared prompt blocks)
BUDGETS = [5, 3, 6]  # tokens per turn of each episode
CONTEXT = [TOK.encode("+1="), TOK.encode("7"), TOK.encode("=23+")]  # the context appended after turn k
OTHERS = [
    Request("47+38=", max_tokens=7, id="a"),
    Request("5=", max_tokens=4, id="b"),
    Request("3+3=", max_tokens=24, id="c")
]  # rows of at most 29 tokens, as the episodes': paged calls attend to 16 or 32 columns
SESSION = dict(slots=4, max_new_tokens=40)  # rows of 16 + 40 = 56 tokens
PAGED = dict(kv_page_size=4, kv_blocks=80)  # 40 blocks per shard: room for every held sequence
FRESH = dict(slots=4, max_prompt_len=36, max_new_tokens=20)  # any row here as a prompt, in rows of 56 tokens


@pytest.fixture(scope="module")
def weights(pools):
  return policy_weights(CFG, pools["rollout"])


def policy_weights(cfg, pool):
  """-> (policy, weights v0 on `pool`, other weights: v0's tensors plus Gaussian noise of each one's
  spread, drawn on the host; a second Policy.init would compile the initializer again, its seed
  being part of the program)."""
  policy = Policy.build(cfg)
  shardings = pool.shardings_for(policy.logical_axes(), policy.shapes())
  params = policy.init(0, shardings)
  rng = np.random.default_rng(1)
  noisy = lambda x: x + x.std() * rng.standard_normal(x.shape).astype(x.dtype)
  return policy, params, jax.device_put(jax.tree.map(lambda x: noisy(np.asarray(x)), params), shardings)


def session_engine(pools, policy, params, greedy=True, **kw):
  engine = make_engine(pools, policy, **dict(SESSION, **kw))
  engine.load_weights(0, params)
  engine.greedy = greedy
  return engine


@pytest.fixture(scope="module")
def shared(pools, weights):
  """shared(greedy, **options) -> the module's session_engine of these options, idle, on weights
  v0: built once, its compiled programs serve every test that asks for it; rebuilt when a test
  left it busy."""
  policy, params, _ = weights
  built = {}

  def get(greedy=True, **options):
    key = tuple(sorted(options.items()))
    engine = built.get(key)
    if engine is None or engine.pending or engine.held:
      engine = built[key] = session_engine(pools, policy, params, **options)
    engine.load_weights(0, params)
    engine.greedy = greedy
    return engine

  return get


@pytest.fixture(scope="module")
def reference(pools, weights):
  """The engine of fresh prompts (ring, greedy) the turns are compared with."""
  engine = make_engine(pools, weights[0], **FRESH)
  engine.greedy = True
  return engine


def play(engine, turns=3, others=OTHERS):
  """The episodes of PROMPTS for `turns` turns each, one of `others` submitted per poll
  -> ({(episode, sample): [its turns' samples]}, [the others' samples])."""
  engine.submit([
      Request(p, n=1 + (e == 1), max_tokens=b, id=e, key=jax.random.key(e), hold=True)
      for e, (p, b) in enumerate(zip(PROMPTS, BUDGETS))
  ])
  episodes, rest, queue = {}, [], list(others)
  while engine.pending or queue:
    if queue:
      engine.submit([queue.pop(0)])
    for s in engine.poll():
      if isinstance(s.request_id, str):
        rest.append(s)
        continue
      e, j = (s.request_id, s.index) if isinstance(s.request_id, int) else s.request_id
      done = episodes.setdefault((e, j), [])
      done.append(s)
      assert s.session is not None and len(s.tokens) == BUDGETS[e]
      if len(done) < turns:
        engine.extend(s.session, CONTEXT[len(done) - 1], max_tokens=BUDGETS[e], id=(e, j))
      else:
        engine.drop(s.session)
  assert engine.held == 0 and (not engine.paged or engine.blocks.held == 0)
  return episodes, rest


def fresh(reference, params, rows):
  """Greedy samples of (row, tokens) pairs, each row submitted as a fresh prompt."""
  reference.load_weights(0, params)
  reference.submit([Request(row, max_tokens=n, id=i) for i, (row, n) in enumerate(rows)])
  out = []
  while reference.pending:
    out += reference.poll()
  return sorted(out, key=lambda s: s.request_id)


def assert_like_fresh(reference, params, samples):
  """Each turn's tokens and logprobs are those of its row (the row before it) as a fresh prompt."""
  for s, ref in zip(samples, fresh(reference, params, [(s.prompt_tokens, len(s.tokens)) for s in samples])):
    assert s.tokens.tolist() == ref.tokens.tolist()
    np.testing.assert_allclose(s.logprobs, ref.logprobs, atol=1e-5)


@pytest.mark.parametrize("layout", ["paged", "ring"])
def test_held_sessions_continue_as_fresh_rows_and_paged_runs_only_the_new_tokens(pools, weights, reference, layout):
  policy, params, _ = weights
  engine = session_engine(pools, policy, params, **(PAGED if layout == "paged" else {}))  # new: holds warmup's
  engine.warmup([7], 1, turn_lengths=[len(c) for c in CONTEXT])
  warm = {key for key in engine._fns if key[0] == "extend"}
  assert warm == ({("extend", n, 16) for n in (2, 4)} if layout == "paged" else set())  # 1 or 2 rows per shard
  episodes, rest = play(engine)
  assert {key for key in engine._fns if key[0] == "extend"} == warm
  assert sorted(episodes) == [(0, 0), (1, 0), (1, 1), (2, 0)] and all(len(t) == 3 for t in episodes.values())
  assert sorted(s.request_id for s in rest) == ["a", "b", "c"] and all(s.session is None for s in rest)
  turns = [s for t in episodes.values() for s in t]
  for e, j in episodes:  # each turn's row: the last one's, its tokens and the context
    first, second, third = episodes[e, j]
    assert second.prompt_tokens == first.prompt_tokens + first.tokens.tolist() + CONTEXT[0]
    assert third.prompt_tokens == second.prompt_tokens + second.tokens.tolist() + CONTEXT[1]
  assert_like_fresh(reference, params, turns)
  assert engine.preemptions == 0 and engine.held_evictions == 0
  # turn 0 prefills each prompt once (a group's too) and the others' prompts
  prompts = sum(len(episodes[e, 0][0].prompt_tokens) for e in range(3)) + sum(len(s.prompt_tokens) for s in rest)
  later = [s for t in episodes.values() for s in t[1:]]
  if layout == "paged":  # a turn runs its context and the last sampled token, never cached before
    assert engine.prefill_tokens == prompts + sum(len(CONTEXT[k]) + 1 for t in episodes.values() for k in range(2))
  else:  # the whole row again
    assert engine.prefill_tokens == prompts + sum(len(s.prompt_tokens) for s in later)


def test_sampled_turns_are_the_same_paged_and_in_the_ring_and_score_as_the_trainer(weights, shared):
  """Turn k draws with fold_in(fold_in(key, k), c): the layout, batch and slot change nothing."""
  policy, params, _ = weights
  (paged, _), (ring, _) = (play(shared(greedy=False, **kw)) for kw in (PAGED, {}))
  for key in ring:
    for a, b in zip(paged[key], ring[key]):
      assert a.tokens.tolist() == b.tokens.tolist() and a.prompt_tokens == b.prompt_tokens
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
  assert len({tuple(s.tokens) for s in paged[1, 0] + paged[1, 1]}) > 1  # the group's samples differ
  assert_parity(policy, {0: params}, [s for t in paged.values() for s in t])


@pytest.mark.parametrize("reason", ["eos", "stop"])
def test_a_turn_ended_by_eos_or_a_stop_string_continues_from_its_cut(weights, shared, reference, reason):
  """A stop string cuts the host's tokens after the device cached more: the KV before the cut is
  still the row's (a position's KV depends on the tokens up to it), so it is reused too."""
  _, params, _ = weights
  (free,) = fresh(reference, params, [([TOK.bos_id] + TOK.encode("12+34="), 12)])  # "68" and EOS, greedily
  free = free.tokens
  engine = shared(eos_ids=(TOK.eos_id,), **PAGED)
  # the host finds the stop string "68" after a call of 4 steps
  stop, cut = ((), 3) if reason == "eos" else ((TOK.decode(free[:2]),), 2)
  engine.submit([Request("12+34=", max_tokens=12, hold=True, stop=stop)])
  (first,) = engine.poll() + engine.poll() + engine.poll()
  assert first.finish_reason == reason and first.tokens.tolist() == free[:cut].tolist()
  before = engine.prefill_tokens
  engine.extend(first.session, CONTEXT[0], max_tokens=6)
  (second,) = engine.poll() + engine.poll()
  assert engine.prefill_tokens - before == len(CONTEXT[0]) + 1 and engine.held_evictions == 0
  assert_like_fresh(reference, params, [first, second])
  engine.drop(second.session)


def test_a_weight_switch_between_turns_prefills_the_whole_row_with_the_new_weights(weights, shared, reference):
  _, old, new = weights
  engine = shared(**PAGED)
  engine.submit([Request("12+34=", max_tokens=6, hold=True)])
  (first,) = engine.poll() + engine.poll()
  assert engine.blocks.held == 3  # 7 + 6 tokens, 12 cached
  engine.load_weights(1, new)  # nothing in flight: applied now, the held KV is stale
  assert engine.blocks.held == 0 and engine.held == 1
  before = engine.prefill_tokens
  engine.extend(first.session, CONTEXT[0], max_tokens=6)
  (second,) = engine.poll() + engine.poll()
  assert engine.prefill_tokens - before == len(second.prompt_tokens) and (second.versions == 1).all()
  assert_like_fresh(reference, new, [second])
  engine.drop(second.session)


@pytest.mark.parametrize("layout", ["paged", "ring"])
def test_a_weight_switch_inside_a_turn_gives_each_token_its_version(weights, shared, layout):
  policy, old, new = weights
  engine = shared(greedy=False, **(PAGED if layout == "paged" else {}))
  engine.submit([Request("12+34=", max_tokens=6, hold=True, key=jax.random.key(3))])
  (first,) = engine.poll() + engine.poll()
  engine.extend(first.session, CONTEXT[0], max_tokens=12, hold=False)
  second = engine.poll()  # 4 steps on v0
  engine.load_weights(1, new)  # in flight: at the next step boundary, its KV recomputed
  while engine.pending:
    second += engine.poll()
  (second,) = second
  assert second.versions.tolist() == [0] * 4 + [1] * 8 and second.session is None and engine.held == 0
  assert_parity(policy, {0: old, 1: new}, [first, second])


def test_a_dry_pool_evicts_held_kv_first_and_rebuilds_it(pools, weights, shared):
  policy, params, _ = weights
  ample, _ = play(shared(**PAGED))
  # rows of 40 tokens, 10 blocks of 4 per shard: one longest row each, so held sequences lose their KV to the others
  engine = session_engine(pools, policy, params, max_new_tokens=24, kv_page_size=4, kv_blocks=20)
  tight, _ = play(engine)
  assert engine.held_evictions > 0
  for key in ample:
    for a, b in zip(ample[key], tight[key]):
      assert a.tokens.tolist() == b.tokens.tolist() and a.prompt_tokens == b.prompt_tokens
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_drop_frees_the_blocks_and_a_dropped_session_cannot_be_extended(shared):
  engine = shared(**PAGED)
  engine.submit([Request("99+99+9=", n=2, max_tokens=6, hold=True)])
  samples = engine.poll() + engine.poll()
  assert engine.held == 2 and engine.blocks.held == 2 + 2 * 2  # 2 shared prompt blocks, 2 of each sample's own
  with pytest.raises(UserError, match="a row of 56 tokens"):
    engine.extend(samples[0].session, [1] * 41)
  engine.drop(samples[0].session)
  engine.drop(samples[0].session)  # idempotent
  assert engine.held == 1 and engine.blocks.held == 2 + 2
  with pytest.raises(UserError, match="is not held"):
    engine.extend(samples[0].session, CONTEXT[0])
  engine.extend(samples[1].session, CONTEXT[0], max_tokens=4)
  engine.drop(samples[1].session)  # queued: freed when its turn ends
  (last,) = engine.poll() + engine.poll()
  assert last.session is None and engine.held == 0
  assert engine.blocks.held == 0 and engine.blocks.free(0) == engine.blocks.free(1) == 40


def test_the_ring_takes_rows_longer_than_a_prompt(weights, shared, reference):
  """A ring row longer than max_prompt_len - 1 cached tokens: when the ring rewinds, the prompts
  end after it; while others decode it wraps to the ring's end and decode reads the whole ring."""
  _, params, _ = weights
  engine = shared()  # a ring of 56 columns, prompts end at column 15
  engine.submit([Request("12+34=", max_tokens=12, hold=True)])
  (first,) = engine.poll() + engine.poll() + engine.poll()
  engine.submit([Request("7=", max_tokens=20, id="other")])
  samples = engine.poll()  # rewound to column 15, then 4 steps
  engine.extend(first.session, CONTEXT[2], max_tokens=6)  # 19 + 4 tokens: 22 cached, more than the 19 columns before t
  samples += engine.poll()
  assert engine._t >= engine.length  # wrapped: the whole ring is read
  while engine.pending:
    samples += engine.poll()
  other, second = sorted(samples, key=lambda s: s.request_id is None)
  engine.extend(second.session, CONTEXT[0], max_tokens=4, hold=False)
  engine._admit()
  assert engine._t == len(second.prompt_tokens) + len(second.tokens) + len(CONTEXT[0]) - 1  # rewound after the row
  (third,) = engine.poll()
  assert [len(s.tokens) for s in (first, other, second, third)] == [12, 20, 6, 4]
  assert_like_fresh(reference, params, [first, other, second, third])


def test_without_kv_reuse_a_paged_engine_samples_the_same_turns_and_prefills_whole_rows(pools, weights):
  """reuse_kv=False (benchmarks/episodes.py's baseline): held sequences keep no blocks between
  turns, so each later turn prefills its whole row, as the ring does; the samples do not change."""
  policy, params, _ = weights
  reused, _ = play(session_engine(pools, policy, params, greedy=False, **PAGED))
  engine = session_engine(pools, policy, params, greedy=False, reuse_kv=False, **PAGED)
  engine.submit([Request("12+34=", max_tokens=5, hold=True)])
  (first,) = engine.poll() + engine.poll()
  assert engine.held == 1 and engine.blocks.held == 0
  engine.drop(first.session)
  before = engine.prefill_tokens
  episodes, rest = play(engine)
  for key in reused:
    for a, b in zip(reused[key], episodes[key]):
      assert a.tokens.tolist() == b.tokens.tolist() and a.prompt_tokens == b.prompt_tokens
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  prompts = sum(len(episodes[e, 0][0].prompt_tokens) for e in range(3)) + sum(len(s.prompt_tokens) for s in rest)
  later = sum(len(s.prompt_tokens) for t in episodes.values() for s in t[1:])
  assert engine.prefill_tokens - before == prompts + later
  assert not any(key[0] == "extend" for key in engine._fns) and engine.held_evictions == 0
