"""Continuous batching: slot refill, shared group prefill, interruption, stop strings, memory.

Correctness is checked against the trainer: every behaviour logprob must equal
rl.layout.token_logprobs of the same tokens under the weights of that token's version, which
only holds if each refilled slot's KV (and each recomputed KV) is exactly right.
"""
import functools
import re

import jax
import numpy as np
import pytest

from jaxrl_hex import meshes
from jaxrl_hex.data.rollouts import bucket
from jaxrl_hex.errors import UserError
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.rl.batch import TrainBatch
from jaxrl_hex.rl.layout import token_logprobs
from jaxrl_hex.rollout import slots as S
from jaxrl_hex.rollout.engine import Engine, Request

CFG = model_config(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                   tie_embeddings=True)
TOK = CharTokenizer("0123456789+=")
NO_EOS = (99,)  # an id the model never samples: lengths are set by the token budgets
TEMP = 1.3


@pytest.fixture(scope="module")
def weights(pools):
  policy = Policy.build(CFG)
  shardings = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  return policy, policy.init(0, shardings), policy.init(1, shardings)


def make_engine(pools, policy, **kw):
  kw = dict(dict(temperature=TEMP, slots=2, max_prompt_len=16, eos_ids=NO_EOS, steps_per_sync=4), **kw)
  return Engine(policy, pools["rollout"], TOK, kw.pop("max_new_tokens", 8), **kw)


def run(engine, requests, on_poll=None):
  engine.submit(requests)
  samples, polls = [], 0
  while engine.pending:
    if on_poll is not None:
      on_poll(polls)
    samples += engine.poll()
    polls += 1
  return samples


def trainer_logprobs(policy, params, samples):
  """token_logprobs of each sample's completion, laid out as rl.batch lays out a rollout."""
  p_len = bucket(max(len(s.prompt_tokens) for s in samples))
  c_len = max(len(s.tokens) for s in samples)
  n = len(samples)
  tokens, valid = np.zeros((n, p_len + c_len), np.int32), np.zeros((n, p_len + c_len), bool)
  for i, s in enumerate(samples):
    tokens[i, p_len - len(s.prompt_tokens):p_len] = s.prompt_tokens
    tokens[i, p_len:p_len + len(s.tokens)] = s.tokens
    valid[i, p_len - len(s.prompt_tokens):p_len + len(s.tokens)] = True
  batch = TrainBatch(tokens=tokens, valid=valid, loss_mask=valid[:, p_len:])
  logp, _ = jax.jit(lambda p, b: token_logprobs(policy, p, b, temperature=TEMP))(params, batch)
  return [np.asarray(logp)[i, :len(s.tokens)] for i, s in enumerate(samples)]


def assert_parity(policy, params_by_version, samples):
  """Each token's behaviour logprob equals the trainer's under the weights of its version."""
  checked = 0
  for version, params in params_by_version.items():
    ref = trainer_logprobs(policy, params, samples)
    for s, r in zip(samples, ref):
      mine = s.versions == version
      np.testing.assert_allclose(s.logprobs[mine], r[mine], atol=1e-4)
      checked += int(mine.sum())
  assert checked == sum(len(s.tokens) for s in samples)


def test_slots_refill_in_fifo_order_and_every_request_is_answered_once(pools, weights):
  policy, params, _ = weights
  engine = make_engine(pools, policy)
  engine.load_weights(3, params)
  budgets = [3, 8, 2, 5, 1]
  prompts = ["1+2=", "47+38=", "5=", "99+99+9=", "0="]  # 4 prefill lengths
  samples = run(engine, [Request(p, max_tokens=b, id=i) for i, (p, b) in enumerate(zip(prompts, budgets))])
  # 2 slots: r0 (3) | r1 (8); r2 takes r0's slot after step 3, r3 takes it after step 5, r4 takes r1's
  # after step 8 and ends at step 9, r3 at step 10 (the same hand-back: reported in slot order)
  assert [s.request_id for s in samples] == [0, 2, 1, 3, 4]
  assert engine.decode_steps == 10
  assert [len(s.tokens) for s in sorted(samples, key=lambda s: s.request_id)] == budgets
  assert all(s.finish_reason == "length" and s.truncated and (s.versions == 3).all() for s in samples)
  assert_parity(policy, {3: params}, samples)
  assert engine.compile_count <= 4  # decode + prefill buckets (1 or 2 prompts, 16 tokens)
  assert engine.pending == 0 and engine.poll() == []


def test_submit_keys_follow_submission_order_and_given_keys(pools, weights):
  """One submit derives every sample's key in one call: request k (counted over all submits) without
  a key draws from fold_in(engine.rng, k), one with a key (typed or raw data) from it; sample j
  from fold_in(that key, j). A request the engine refuses queues none of its batch."""
  policy, _, _ = weights
  engine = make_engine(pools, policy, slots=4)
  data = lambda key: np.asarray(jax.random.key_data(key))
  typed, raw = jax.random.key(11), jax.random.key_data(jax.random.key(12))
  with pytest.raises(UserError, match="max_prompt_len"):
    engine.submit([Request("1="), Request("1" * 40)])
  assert engine.queued == 0
  engine.submit([Request("1=", n=2), Request("2=", n=3, key=typed), Request("3=")])
  engine.submit([Request("4=", n=4, key=raw), Request("5=")])
  want = [(jax.random.fold_in(engine.rng, 0), 2), (typed, 3), (jax.random.fold_in(engine.rng, 2), 1),
          (jax.random.wrap_key_data(raw), 4), (jax.random.fold_in(engine.rng, 4), 1)]
  got = [[seq.key for seq in entry] for entry in engine._queue]
  assert [len(g) for g in got] == [n for _, n in want]
  for keys, (key, _) in zip(got, want):
    np.testing.assert_array_equal(keys, [data(jax.random.fold_in(key, j)) for j in range(len(keys))])
  assert len({k.tobytes() for keys in got for k in keys}) == 11  # every sample its own key


def test_shared_group_prefill_equals_separate_prefills(pools, weights):
  policy, params, _ = weights
  outs, caches = [], []
  for requests in ([Request("12+34=", n=4)], [Request("12+34=") for _ in range(4)]):
    engine = make_engine(pools, policy, slots=4)
    engine.load_weights(0, params)
    engine.greedy = True  # sample keys differ between one request of 4 and 4 requests: compare the argmax
    engine.submit(requests)
    engine._admit()
    caches.append(jax.device_get(engine._state.cache))
    samples = run(engine, [])
    outs.append(sorted(samples, key=lambda s: (s.request_id or 0, s.index)))
  for a, b in zip(*caches):
    np.testing.assert_allclose(a[0], b[0], atol=1e-6)
    np.testing.assert_allclose(a[1], b[1], atol=1e-6)
  assert [s.tokens.tolist() for s in outs[0]] == [s.tokens.tolist() for s in outs[1]]
  np.testing.assert_allclose(np.stack([s.logprobs for s in outs[0]]), np.stack([s.logprobs for s in outs[1]]),
                             atol=1e-5)


def test_a_fresh_batch_decodes_on_the_ring_columns_it_has_written(pools, weights):
  """Decode attends to ring columns [0, span) until the ring wraps: the same tokens, logprobs and
  state as attending to the whole ring, and the trainer's logprobs across span changes."""
  policy, params, _ = weights
  engine = make_engine(pools, policy, slots=4, max_new_tokens=40)  # ring of 56 columns, quarters of 14
  engine.load_weights(0, params)
  requests = [Request("12+34=", n=2, max_tokens=40), Request("7=", n=2, max_tokens=23)]
  engine.submit(requests)
  engine._admit()
  span = engine._span(engine._t + engine.steps_per_sync)
  assert (engine._t, span, engine.length) == (15, 28, 56)
  state = jax.device_get(engine._state)
  outs = []
  for cols in (span, engine.length):
    decode = jax.jit(functools.partial(S.decode, policy, engine.sampling, NO_EOS, 4, cols))
    outs.append(jax.device_get(decode(params, state, engine._live, np.bool_(False))))
  (narrow, narrow_out), (whole, whole_out) = outs
  assert narrow_out.steps == whole_out.steps == 4
  np.testing.assert_array_equal(narrow_out.tokens, whole_out.tokens)
  np.testing.assert_allclose(narrow_out.logprobs, whole_out.logprobs, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), narrow, whole)

  samples = run(engine, [])  # 40 steps from column 15: spans 28, 42 and the whole ring
  assert {key[1] for key in engine._fns if key[0] == "decode"} == {28, 42, 56}
  assert sorted(len(s.tokens) for s in samples) == [23, 23, 40, 40]
  assert_parity(policy, {0: params}, samples)


def decode_calls(engine) -> list:
  """The (span, slots) of each decode call the engine makes from now on, as they are made."""
  calls, pick = [], engine._call

  def logged(span):
    span, rows = pick(span)
    calls.append((span, engine.num_slots if rows is None else len(rows)))
    return span, rows

  engine._call = logged
  return calls


def test_a_ring_decode_call_runs_on_its_live_slots_as_on_all_of_them(pools, weights):
  """A long tail on the ring: once few slots are live a call runs on those of each data shard
  (slots.decode's rows: their cache rows copied out and back) at the ring's whole width, which
  reads fewer columns than all slots at the call's span, and every request samples the tokens
  and logprobs it samples where every call runs on all 16 slots, the trainer's. An engine warmed
  up runs the same calls, programs its warmup compiled: it compiles none mid-run."""
  policy, params, _ = weights
  budgets = [3] * 5 + [20] + [3] * 7 + [17, 2, 3]  # slots 5 and 13 (one in each data shard's 8) go on alone
  prompts = [f"{i}+{i}=" for i in range(len(budgets))]
  samples, calls, programs = {}, {}, {}
  for name in ("rows", "warmed", "all"):
    engine = make_engine(pools, policy, slots=16, max_new_tokens=20)  # a ring of 36 columns, quarters of 9
    if name == "all":
      engine._row_buckets = lambda: [8]
    if name == "warmed":
      engine.warmup([len(TOK.encode(p)) + 1 for p in prompts], 1)  # + BOS
      compiled = engine.compile_count
    engine.load_weights(0, params)
    calls[name] = decode_calls(engine)
    requests = [Request(p, max_tokens=b, id=i) for i, (p, b) in enumerate(zip(prompts, budgets))]
    samples[name] = sorted(run(engine, requests), key=lambda s: s.request_id)
    programs[name] = {key[1:] for key in engine._fns if key[0] == "decode"}
    if name == "warmed":
      assert engine.compile_count == compiled
  # 2 slots: one of each shard; the ring wraps at the fourth call
  assert calls["rows"] == calls["warmed"] == [(27, 16), (36, 2), (36, 2), (36, 2), (36, 2)]
  assert calls["all"] == [(27, 16), (27, 16), (27, 16), (36, 16), (36, 16)]
  assert programs["rows"] == {(27, 16), (36, 2)}  # a program per span on all slots, per bucket at the width
  for name in ("rows", "warmed"):
    for mine, full in zip(samples[name], samples["all"]):
      np.testing.assert_array_equal(mine.tokens, full.tokens)
      np.testing.assert_allclose(mine.logprobs, full.logprobs, atol=1e-5)
  assert [len(s.tokens) for s in samples["rows"]] == budgets
  assert_parity(policy, {0: params}, samples["rows"])


def decode_loop(engine) -> str:
  """The loop of the engine's compiled decode program (its largest while body), as HLO text."""
  fn, args = engine.decode_program()
  hlo = fn.lower(*args).compile().as_text()
  bodies = re.findall(r"body=%?([\w.\-]+)", hlo)
  computations = {m.group(1): m.group(2) for m in re.finditer(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.M | re.S)}
  return max((computations[b] for b in bodies), key=len)


def loop_copies(engine) -> int:
  """Copies of arrays of 3 or more axes (a KV cache, or a paged call's copy of it) in the decode loop."""
  return len(re.findall(r"= \w+\[\d+,\d+,\d+[\d,]*\]\S* copy\(", decode_loop(engine)))


def test_a_decode_step_writes_its_cache_in_place_on_either_layout(pools, weights):
  """A pool whose shards hold one KV head each (the rollout pool: 2 heads over tensor=2) keeps its
  ring or block pool flat, one with whole heads (a single device) 4-d; on each the decode loop
  writes a step's column in place (the 4-d layout on one head a shard made 4 copies of each
  layer's cache, or of a paged call's copy of it, per step), and the logprobs are the trainer's."""
  policy, params, _ = weights
  one = meshes.Pool(meshes.PoolSpec("rollout", (4,), {}, dict(meshes.DEFAULT_RULES)))
  for pool, page, flat, shape in ((pools["rollout"], 0, True, (4, 16, 24)), (one, 0, False, (4, 2, 8, 24)),
                                  (pools["rollout"], 4, True, (24, 16, 4)), (one, 4, False, (24, 2, 8, 4))):
    engine = Engine(policy, pool, TOK, 8, temperature=TEMP, slots=4, max_prompt_len=16, eos_ids=NO_EOS,
                    steps_per_sync=4, kv_page_size=page)
    engine.load_weights(0, jax.device_put(params, engine.param_shardings))
    samples = run(engine, [Request("12+34=", n=2), Request("7=", n=3, max_tokens=6)])
    assert loop_copies(engine) == 0
    assert engine.layout.flat is flat and engine._state.cache[0][0].shape == shape
    assert sorted(len(s.tokens) for s in samples) == [6, 6, 6, 8, 8]
    assert_parity(policy, {0: params}, samples)


def test_a_prefill_splits_its_prompt_rows_over_the_data_axis(pools, weights):
  """The prompt rows arrive replicated; the model's activations take the pool's batch axes, so
  on the rollout pool (data 2 x tensor 2) each device projects half of them (unconstrained,
  every data shard ran all rows: W1's prefill on 2 x 2 at 0.41 of its matmul chain), and the
  slots, which take rows of either half, still decode as the trainer scores."""
  policy, params, _ = weights
  engine = make_engine(pools, policy, slots=4)
  engine.load_weights(0, params)
  samples = run(engine, [Request("12+34=", n=2), Request("7=", max_tokens=5), Request("9+1=", max_tokens=6)])
  assert sorted(len(s.tokens) for s in samples) == [5, 6, 8, 8]
  assert_parity(policy, {0: params}, samples)
  (n_b, p_b, _), = [key[1:] for key in engine._fns if key[0] == "prefill"]
  hlo = engine._fns[("prefill", n_b, p_b, _)].as_text()
  # the query projection's rows on each device: [tokens, heads x head_dim / tensor]
  rows = {int(m) for m in re.findall(r"= f32\[(\d+),16\]\S* dot\(", hlo)}
  assert n_b == 4 and rows == {n_b * p_b // 2}, (n_b, p_b, rows)


def test_a_prefill_on_a_mesh_runs_the_attention_kernel_on_each_device(pools):
  """With model.attention_kernel=pallas (what auto picks on GPU and TPU) a prefill's attention
  runs the kernel in a shard_map over each device's rows and KV heads (XLA cannot partition a
  kernel; with no activation sharding the engine ran it whole on every device), on CPU in
  interpret mode, and the samples score as the trainer's portable path does."""
  kernel, portable = (Policy.build(model_config(**dict(CFG, attention_kernel=k))) for k in ("pallas", "portable"))
  params = kernel.init(0, pools["rollout"].shardings_for(kernel.logical_axes(), kernel.shapes()))
  engine = make_engine(pools, kernel, slots=4)
  engine.load_weights(0, params)
  samples = run(engine, [Request("12+34=", n=2), Request("7=", max_tokens=5), Request("9+1=", max_tokens=6)])
  assert_parity(portable, {0: params}, samples)
  prefill, = [program for key, program in engine._fns.items() if key[0] == "prefill"]
  assert 'op_name="jit(prefill)/shard_map/jit(mha)' in prefill.as_text()  # (Pallas's Triton attention, mha)


def test_a_call_draws_its_steps_uniforms_before_its_loop_as_each_step_would(pools, weights):
  """A slot's token c is drawn with fold_in(key, c) however many steps a call runs (slots that
  stop mid-call, refills): the same samples at 1 and 5 steps a call, on the ring and paged; and
  the decode loop runs no RNG (threefry's loops were over half its thunks)."""
  policy, params, _ = weights
  requests = lambda: [Request("12+34=", n=2, max_tokens=7), Request("7=", n=3, max_tokens=3), Request("9+1=")]
  for page in (0, 4):
    got = []
    for steps in (1, 5):
      engine = make_engine(pools, policy, slots=4, steps_per_sync=steps, kv_page_size=page)
      engine.load_weights(0, params)
      engine.rng = jax.random.key(11)
      samples = sorted(run(engine, requests()), key=lambda s: (s.request_id, s.index))
      got.append([(s.tokens.tolist(), s.logprobs.tolist()) for s in samples])
      assert " while(" not in decode_loop(engine)
    assert [t for t, _ in got[0]] == [t for t, _ in got[1]]
    assert sorted(len(t) for t, _ in got[0]) == [3, 3, 3, 7, 7, 8]
    # (other programs: the logprobs may differ in their last bits)
    np.testing.assert_allclose(sum((lp for _, lp in got[0]), []), sum((lp for _, lp in got[1]), []), atol=1e-5)


def test_a_sliding_window_model_decodes_as_the_trainer_scores(pools):
  """Sliding-window layers with their own RoPE (Gemma 3 style) through refills and ring spans."""
  cfg = model_config(vocab_size=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                     tie_embeddings=True, sliding_window=4, layer_types=("sliding", "sliding", "full"),
                     rope_local_theta=100.0, rope_scaling={
                         "rope_type": "linear",
                         "factor": 2.0
                     })
  policy = Policy.build(cfg)
  params = policy.init(0, pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes()))
  engine = make_engine(pools, policy, max_new_tokens=24)  # 2 slots, a ring of 40 columns
  engine.load_weights(0, params)
  budgets = {"12+34=": 24, "7=": 5, "99+1=": 12, "3+3=": 20}
  samples = run(engine, [Request(p, max_tokens=b) for p, b in budgets.items()])
  assert {key[1] for key in engine._fns if key[0] == "decode"} == {20, 30, 40}
  assert sorted(len(s.tokens) for s in samples) == sorted(budgets.values())
  assert_parity(policy, {0: params}, samples)


def test_interruption_recomputes_kv_and_keeps_every_token(pools, weights):
  policy, old, new = weights
  fresh = iter([None, (5, new)])  # the trainer publishes v5 after the first hand-back
  engine = make_engine(pools, policy, weights_source=lambda: next(fresh, None), max_new_tokens=12)
  engine.load_weights(4, old)
  samples = run(engine, [Request(p, max_tokens=12, id=i) for i, p in enumerate(["1+2=", "47+38=", "5="])])
  assert sorted(s.request_id for s in samples) == [0, 1, 2]
  assert all(len(s.tokens) == 12 for s in samples)  # none lost, none duplicated
  first = next(s for s in samples if s.request_id == 0)
  assert first.versions.tolist() == [4] * 4 + [5] * 8  # switched at the step boundary, mid-sequence
  assert_parity(policy, {4: old, 5: new}, samples)


def test_interruption_continues_as_a_run_on_the_new_weights_would(pools, weights):
  """Greedy: after the switch, tokens equal a fresh v5 run fed the prompt + the tokens kept."""
  policy, old, new = weights
  engine = make_engine(pools, policy, max_new_tokens=12)
  engine.load_weights(0, old)
  engine.greedy = True
  samples = run(engine, [Request("47+38=", max_tokens=12)], on_poll=lambda i: i == 1 and engine.load_weights(1, new))
  (s,) = samples
  k = int((s.versions == 0).sum())
  assert 0 < k < 12
  fresh = make_engine(pools, policy, max_new_tokens=12)
  fresh.load_weights(1, new)
  fresh.greedy = True
  (ref,) = run(fresh, [Request(s.prompt_tokens + s.tokens[:k].tolist(), max_tokens=12 - k)])
  assert s.tokens[k:].tolist() == ref.tokens.tolist()
  np.testing.assert_allclose(s.logprobs[k:], ref.logprobs, atol=1e-5)


def test_interrupt_finish_lets_in_flight_sequences_end_on_old_weights(pools, weights):
  policy, old, new = weights
  engine = make_engine(pools, policy, interrupt="finish")
  engine.load_weights(0, old)
  budgets = [8, 6, 3]
  samples = run(engine, [Request("1+2=", max_tokens=b, id=i) for i, b in enumerate(budgets)],
                on_poll=lambda i: i == 1 and engine.load_weights(1, new))
  by_id = {s.request_id: s for s in samples}
  assert [len(by_id[i].tokens) for i in range(3)] == budgets
  assert (by_id[0].versions == 0).all() and (by_id[1].versions == 0).all()  # in flight at the switch
  assert (by_id[2].versions == 1).all()  # waited for a slot until the switch
  assert_parity(policy, {0: old, 1: new}, samples)


def test_stop_string_split_across_tokens(pools, weights):
  policy, params, _ = weights
  engine = make_engine(pools, policy, max_new_tokens=12)
  engine.load_weights(0, params)
  (free,) = run(engine, [Request("12+34=", max_tokens=12, key=jax.random.key(6))])
  text = TOK.decode(free.tokens)
  stop = text[3:5]  # two characters = two tokens
  end = text.index(stop) + 2
  (cut,) = run(engine, [Request("12+34=", max_tokens=12, stop=(stop,), key=jax.random.key(6))])
  assert cut.finish_reason == "stop" and not cut.truncated
  assert cut.text == text[:end] and cut.tokens.tolist() == free.tokens[:end].tolist()
  np.testing.assert_allclose(cut.logprobs, free.logprobs[:end],
                             rtol=1e-6)  # same tokens; fp32 rounding of threaded reductions


def test_memory_is_reported_and_a_cache_that_does_not_fit_is_refused(pools, weights):
  policy, _, _ = weights
  engine = make_engine(pools, policy, slots=4, max_new_tokens=8)
  # 2 layers x (k, v) x 4 slots x (16 + 8) tokens x 2 kv heads x 8 dims x 4 bytes
  assert engine.memory["kv_cache_bytes"] == 2 * 2 * 4 * 24 * 2 * 8 * 4
  # the rollout pool splits slots over data=2 and kv heads over tensor=2
  assert engine.memory["kv_cache_bytes_per_device"] == engine.memory["kv_cache_bytes"] // 4
  with pytest.raises(
      UserError, match=r"KV cache for 512 slots x 4104 tokens needs 0\.13 GiB per device .*"
      r"budget is 0\.05 GiB \(rollout.memory_budget_gb\)"):
    make_engine(pools, policy, slots=512, max_prompt_len=4096, memory_budget_gb=0.05)
  with pytest.raises(UserError, match="does not fit rollout.max_prompt_len=16"):
    engine.submit([Request("1+2=" * 5)])
