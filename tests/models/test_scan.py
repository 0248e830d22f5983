"""Scanned layers (model.scan_layers) and rematerialisation (model.remat): the same numbers as the
unrolled model, a program that does not grow with depth, and remat's memory saving."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hex.models.config import CHOICES, model_config
from jaxrl_hex.models.decoder import PagedIndex, causal_mask, init_cache, stack_layers, unstack_layers
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.rl import packing
from jaxrl_hex.rl.layout import Rows, layout_logprobs
from jaxrl_hex.rollout.engine import Engine

LLAMA_LIKE = dict(vocab_size=32, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True)
# sliding and full layers interleaved, each with its own RoPE: the scan carries which is which
GEMMA_LIKE = dict(LLAMA_LIKE, n_layers=4, qkv_bias=False, qk_norm=True, norm_style="gemma", post_norms=True,
                  sliding_window=3, layer_types=("sliding", "full", "sliding", "full"), rope_local_theta=100.0,
                  rope_scaling={
                      "rope_type": "linear",
                      "factor": 2.0
                  }, tie_embeddings=True)
REMAT = CHOICES["remat"]


def pair(fields, **extra):
  """(unrolled policy, scanned policy, unrolled params, the same params stacked)."""
  flat = Policy.build(model_config(**fields, **extra))
  scanned = Policy.build(model_config(**fields, **extra, scan_layers=True))
  params = flat.init(0)
  return flat, scanned, params, stack_layers(params)


def batch(b=3, t=10, vocab=32):
  tokens = jax.random.randint(jax.random.key(1), (b, t), 3, vocab)
  valid = jnp.ones((b, t), bool).at[1, :3].set(False)  # row 1 is left-padded
  return tokens, jnp.maximum(jnp.cumsum(valid, 1) - 1, 0), valid


def loss(policy, params, tokens, positions, valid):
  logits, _ = policy.apply(params, tokens, positions, causal_mask(valid))
  logp = jax.nn.log_softmax(logits[:, :-1])
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
  return -(picked * valid[:, 1:]).sum() / valid[:, 1:].sum()


@pytest.mark.parametrize("paged", [False, True], ids=["ring", "paged"])
def test_a_scanned_decode_step_writes_each_layers_new_column_in_place(paged):
  """Each layer writes its new key and value columns into the stacked buffers the scan carries
  and reads its own slice: no update in the compiled step is larger than one layer's column
  (taking a layer's slice or pool out and putting it back whole copied it twice more per layer at
  every step). A paged step writes by scatter, so it has no such update at all."""
  _, scanned, _, stacked = pair(LLAMA_LIKE)
  tokens, positions, valid = batch()
  if paged:  # 3 rows over a pool of 6 blocks of 4 positions, 2 blocks a row
    cache = init_cache(scanned.cfg, 6, 4)
    index = PagedIndex(jnp.asarray([[0, 1], [2, 3], [4, 5]], jnp.int32), positions[:, 4], jnp.ones(3, bool))
    mask = jnp.ones((3, 1, 8), bool)
  else:
    cache, index, mask = init_cache(scanned.cfg, 3, 10), 4, valid[:, None]
  step = jax.jit(lambda p, c: scanned.apply(p, tokens[:, :1], positions[:, :1], mask, c, index))
  text = step.lower(stacked, cache).compile().as_text()
  sizes = {
      name: math.prod(map(int, filter(None, dims.split(","))))
      for name, dims in re.findall(r"%(\S+) = \w+\[([\d,]*)\]", text)
  }
  updates = [sizes[name] for name in re.findall(r"dynamic-update-slice\(%\S+, %([^,\s)]+)", text)]
  column = 3 * LLAMA_LIKE["n_kv_heads"] * LLAMA_LIKE["head_dim"]  # B x KV x head_dim
  assert (not updates if paged else len(updates) >= 2) and max(updates, default=0) <= column, updates


def test_scanned_params_are_stacked_on_a_layers_axis():
  flat, scanned, _, stacked = pair(LLAMA_LIKE)
  assert scanned.shapes()["layers"]["attn"]["wq"].shape == (3, 32, 4, 8)
  assert scanned.logical_axes()["layers"]["attn"]["wq"] == ("layers", "qkv_embed", "heads", "head_dim")
  assert jax.tree.structure(stacked) == jax.tree.structure(scanned.shapes())
  fresh = scanned.init(0)["layers"]["mlp"]["up"]  # each layer from its own key
  assert not np.allclose(fresh[0], fresh[1])
  back = unstack_layers(stacked, 3)
  assert jax.tree.structure(back) == jax.tree.structure(flat.shapes())


def test_scanned_layers_shard_like_unrolled_ones(pools):
  flat, scanned, _, _ = pair(LLAMA_LIKE)
  flat_specs = pools["train"].shardings_for(flat.logical_axes(), flat.shapes())
  scanned_specs = pools["train"].shardings_for(scanned.logical_axes(), scanned.shapes())
  for name in ("wq", "wk", "wo"):
    want = (None,) + tuple(flat_specs["layers"][0]["attn"][name].spec)
    assert tuple(scanned_specs["layers"]["attn"][name].spec) == want


@pytest.mark.parametrize("fields", [LLAMA_LIKE, GEMMA_LIKE], ids=["llama", "gemma"])
def test_scanned_logits_cache_and_gradients_equal_unrolled(fields):
  flat, scanned, params, stacked = pair(fields)
  tokens, positions, valid = batch()
  logits = lambda policy: jax.jit(lambda p: policy.apply(p, tokens, positions, causal_mask(valid))[0])
  full = logits(flat)(params)
  np.testing.assert_allclose(logits(scanned)(stacked), full, atol=1e-5)

  def cached(policy, params):  # prefill 6 tokens, then decode one at a time
    prefix, n = 6, tokens.shape[1]
    mask = (jnp.arange(n)[None, :] <= jnp.arange(prefix)[:, None])[None] & valid[:, None, :]
    logits, cache = policy.apply(params, tokens[:, :prefix], positions[:, :prefix], mask & (jnp.arange(n) < prefix),
                                 init_cache(policy.cfg, 3, n), 0)
    steps = [logits]
    for t in range(prefix, n):
      logits, cache = policy.apply(params, tokens[:, t:t + 1], positions[:, t:t + 1],
                                   (valid & (jnp.arange(n) <= t))[:, None, :], cache, t)
      steps.append(logits)
    return jnp.concatenate(steps, 1), cache

  # jitted: one compile per program instead of one per op (the suite's time is compiles)
  flat_logits, flat_cache = jax.jit(lambda p: cached(flat, p))(params)
  scan_logits, scan_cache = jax.jit(lambda p: cached(scanned, p))(stacked)
  assert len(scan_cache) == 1 and scan_cache[0][0].shape == (fields["n_layers"],) + flat_cache[0][0].shape
  np.testing.assert_allclose(scan_logits, flat_logits, atol=1e-5)
  np.testing.assert_allclose(np.asarray(flat_logits)[np.asarray(valid)], np.asarray(full)[np.asarray(valid)], atol=1e-5)
  for i, (k, v) in enumerate(flat_cache):
    np.testing.assert_allclose(scan_cache[0][0][i], k, atol=1e-5)
    np.testing.assert_allclose(scan_cache[0][1][i], v, atol=1e-5)

  g_flat = jax.jit(jax.grad(lambda p: loss(flat, p, tokens, positions, valid)))(params)
  g_scan = jax.jit(jax.grad(lambda p: loss(scanned, p, tokens, positions, valid)))(stacked)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), stack_layers(g_flat), g_scan)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("remat", [r for r in REMAT if r != "none"])
def test_remat_keeps_the_gradient(remat, scan_layers):
  fields = dict(GEMMA_LIKE, scan_layers=scan_layers)
  plain = Policy.build(model_config(**fields))
  remat_policy = Policy.build(model_config(**fields, remat=remat))
  params = plain.init(0)
  tokens, positions, valid = batch()
  grad = lambda policy: jax.jit(jax.value_and_grad(lambda p: loss(policy, p, tokens, positions, valid)))(params)
  (want_loss, want), (got_loss, got) = grad(plain), grad(remat_policy)
  assert float(want_loss) > 1.0
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), want, got)


def compiled_grad(fields, tokens=512, batch_rows=1):
  policy = Policy.build(model_config(**fields))
  data = jax.ShapeDtypeStruct((batch_rows, tokens), jnp.int32)

  def step(params, tokens):
    valid = jnp.ones(tokens.shape, bool)
    return jax.grad(lambda p: loss(policy, p, tokens, jnp.cumsum(valid, 1) - 1, valid))(params)

  return jax.jit(step).lower(policy.shapes(), data).compile()


def test_remat_lowers_the_backward_pass_memory_of_scanned_layers():
  """Unrolled, XLA:CPU schedules every layer's recomputation before the backward pass needs it
  (8 layers: 155 -> 143 MiB), so the saving is measured on the scan, which runs one layer at a time."""
  fields = dict(vocab_size=256, d_model=256, n_layers=8, n_heads=4, n_kv_heads=4, head_dim=64, mlp_dim=768,
                scan_layers=True)
  temp = {r: compiled_grad(dict(fields, remat=r)).memory_analysis().temp_size_in_bytes for r in REMAT}
  # kept per layer: without remat every activation (the [heads, 512, 512] scores and probs the
  # largest), with "full" only the layer's input [512, 256] (measured 206 -> 28 MiB), with "dots"
  # also the projections' and MLP's outputs (65 MiB)
  assert temp["full"] < 0.25 * temp["none"], temp
  assert temp["full"] < temp["dots"] < 0.5 * temp["none"], temp


def test_scanned_program_does_not_grow_with_depth():
  fields = dict(LLAMA_LIKE, vocab_size=64, d_model=64, head_dim=16)
  size = {
      (scan, n): len(compiled_grad(dict(fields, n_layers=n, scan_layers=scan), tokens=16).as_text())
      for scan in (False, True) for n in (2, 8)
  }
  assert size[True, 8] < 1.05 * size[True, 2], size
  assert size[False, 8] > 2.5 * size[False, 2], size
  assert size[True, 8] < 0.5 * size[False, 8], size


def test_engine_greedy_generation_and_logprobs_equal_unrolled(pools):
  fields = dict(GEMMA_LIKE, vocab_size=16)
  tok = CharTokenizer("0123456789+=")
  prompts = ["1+2=", "47+38=", "5=", "99+99+9="]
  flat, scanned, params, stacked = pair(fields)
  outs, memory = [], []
  for policy, p in ((flat, params), (scanned, stacked)):
    engine = Engine(policy, pools["rollout"], tok, max_new_tokens=8, slots=4)
    engine.load_weights(1, jax.device_put(p, engine.param_shardings))
    outs.append(engine.generate(prompts, 2, jax.random.key(0), greedy=True))
    memory.append(engine.memory)
  assert memory[1] == memory[0]
  np.testing.assert_array_equal(outs[1].completion, outs[0].completion)
  np.testing.assert_array_equal(outs[1].completion_mask, outs[0].completion_mask)
  assert outs[0].completion_mask.sum() > 8
  np.testing.assert_allclose(outs[1].behaviour_logprobs, outs[0].behaviour_logprobs, atol=1e-5)


def test_trainer_shared_prompt_logprobs_and_gradients_equal_unrolled():
  """The trainer's shared-prompt path prefills a cache and extends it per completion row."""
  flat, scanned, params, stacked = pair(GEMMA_LIKE, remat="full")
  rng = np.random.default_rng(2)
  valid = np.zeros((4, 12), bool)
  for i, (pl, cl) in enumerate([(3, 7), (3, 4), (5, 6), (5, 2)]):
    valid[i, 5 - pl:5 + cl] = True
  tokens = np.where(valid, rng.integers(1, 32, (4, 12)), 0).astype(np.int32)
  tokens[1, :5], tokens[3, :5] = tokens[0, :5], tokens[2, :5]
  lay = packing.plan(tokens, valid, valid[:, 5:], share_prompts=True, group_ids=np.array([0, 0, 1, 1]))
  fields = ("tokens", "positions", "segments", "seq", "prompt_tokens", "prompt_positions", "prompt_valid", "row_group")
  rows = Rows(**{f: jnp.asarray(getattr(lay, f)[0, 0]) for f in fields})

  def objective(policy, p):
    logp, entropy = layout_logprobs(policy, p, rows, 0.7, chunk=3)
    return (logp * jnp.asarray(rows.segments > 0)).sum() + entropy.sum(), logp

  (_, want), g_flat = jax.jit(jax.value_and_grad(lambda p: objective(flat, p), has_aux=True))(params)
  (_, got), g_scan = jax.jit(jax.value_and_grad(lambda p: objective(scanned, p), has_aux=True))(stacked)
  assert np.asarray(want).std() > 0.1
  np.testing.assert_allclose(got, want, atol=1e-5)
  # sums over every token: fp32 rounding in another order (scan vs unrolled) reaches ~1e-4 relative
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), stack_layers(g_flat), g_scan)


def test_unknown_remat_is_refused_by_name():
  with pytest.raises(ValueError, match=r"remat='offload'; use one of \('none', 'full', 'dots'\)"):
    model_config(remat="offload")
