"""The chunked output head of rl.layout against the whole-vocabulary computation it replaces:
same logprobs, entropies, values and gradients, in a fraction of the compiled temp memory."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.decoder import causal_mask
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.rl import packing
from jaxrl_hex.rl.batch import TrainBatch
from jaxrl_hex.rl.layout import Rows, from_layout, layout_logprobs, layout_values, token_logprobs
from jaxrl_hex.rl.trainer import critic_init, critic_model

SHAPE = dict(vocab_size=61, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
CONFIGS = {
    "tied": model_config(**SHAPE, tie_embeddings=True),
    "untied_softcap": model_config(**SHAPE, tie_embeddings=False, qkv_bias=True, final_logit_softcap=5.0),
}
TEMP = 0.7
TOL = dict(rtol=1e-5, atol=1e-5)


@functools.cache
def _model(name):
  """(policy, params) of CONFIGS[name], made once (the init compile is the slow part)."""
  policy = Policy.build(CONFIGS[name])
  return policy, policy.init(0)


def _whole_vocab(logits, targets, temperature):
  """The computation rl.layout replaced: log_softmax over all of [.., T, V] and its exp."""
  logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
  return logp, -(jnp.exp(logp_all) * logp_all).sum(-1)


def _segment_mask(segments):
  """The dense mask rl.layout's blockwise attention replaced: [R, L, L], query t sees keys s <= t
  of its own sequence."""
  length = segments.shape[1]
  same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)
  return same & jnp.tril(jnp.ones((length, length), bool))[None]


def _whole_vocab_layout_logits(policy, params, rows):
  logits, _ = policy.apply(params, rows.tokens[:, :-1], rows.positions[:, :-1], _segment_mask(rows.segments[:, :-1]))
  return jnp.pad(logits, ((0, 0), (1, 0), (0, 0)))  # [R, L, V]


def _whole_vocab_layout_logprobs(policy, params, rows, temperature=1.0):
  return _whole_vocab(_whole_vocab_layout_logits(policy, params, rows), rows.tokens, temperature)


def _whole_vocab_engine_logprobs(policy, params, batch, temperature):
  """The engine layout [N, P + C], unshared prompts -> (logp, entropy) [N, C]."""
  p_len = batch.tokens.shape[1] - batch.loss_mask.shape[1]
  positions = jnp.maximum(jnp.cumsum(batch.valid, axis=1) - 1, 0)
  logits, _ = policy.apply(params, batch.tokens[:, :-1], positions[:, :-1], causal_mask(batch.valid[:, :-1]))
  return _whole_vocab(logits[:, p_len - 1:], batch.tokens[:, p_len:], temperature)


def _batch(prompt_lens, completion_lens, p, c, vocab, seed=0):
  """Engine layout: left-padded prompts, right-padded completions, random tokens."""
  rng = np.random.default_rng(seed)
  n = len(prompt_lens)
  valid = np.zeros((n, p + c), bool)
  for i, (pl, cl) in enumerate(zip(prompt_lens, completion_lens)):
    valid[i, p - pl:p + cl] = True
  tokens = np.where(valid, rng.integers(1, vocab, (n, p + c)), 0).astype(np.int32)
  return TrainBatch(tokens=tokens, valid=valid, loss_mask=valid[:, p:])


def _micro_batch(lay):
  """Micro-batch (0, 0) of a one-micro-batch Layout as device Rows [R, L]."""
  fields = ("tokens", "positions", "segments", "seq", "prompt_tokens", "prompt_positions", "prompt_valid", "row_group")
  return Rows(**{f: None if getattr(lay, f) is None else jnp.asarray(getattr(lay, f)[0, 0]) for f in fields},
              head_from=lay.head_from)


def _weights(shape, seed):
  a, b = jax.random.normal(jax.random.key(seed), (2, *shape))
  return a, b


def _assert_trees_close(x, y):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), **TOL), x, y)


def _assert_same_and_same_gradients(new, old, params, a, b):
  """new, old: params -> (logp, entropy); their values and the gradients of sum(a * logp + b *
  entropy) agree. -> new's (logp, entropy)."""

  def with_grad(fn):
    objective = lambda p: (lambda out: ((a * out[0] + b * out[1]).sum(), out))(fn(p))
    return jax.jit(jax.value_and_grad(objective, has_aux=True))(params)

  (_, new_out), new_grad = with_grad(new)
  (_, old_out), old_grad = with_grad(old)
  _assert_trees_close(new_out, old_out)
  _assert_trees_close(new_grad, old_grad)
  return new_out


@pytest.mark.parametrize("name, chunk", [("tied", 4), ("untied_softcap", 5), ("tied", 64)])
def test_layout_logprobs_and_gradients_match_whole_vocab(name, chunk):
  policy, params = _model(name)
  batch = _batch([2, 4, 1, 3, 4], [3, 9, 5, 2, 6], p=4, c=9, vocab=61)
  lay = packing.plan(batch.tokens, batch.valid, batch.loss_mask, pack=True, row_length=13)
  rows = _micro_batch(lay)
  assert rows.tokens.shape[1] == 13 and (rows.segments.max(1) > 1).any()  # sequences share rows
  # padding tokens are compared off: their queries see no key, which attention gives zeros
  real = lambda out: jax.tree.map(lambda x: jnp.where(rows.segments > 0, x, 0.0), out)
  new = lambda p: real(layout_logprobs(policy, p, rows, TEMP, chunk))  # L = 13: 4 chunks of 4, 3 of 5, or one
  old = lambda p: real(_whole_vocab_layout_logprobs(policy, p, rows, TEMP))
  logp, entropy = _assert_same_and_same_gradients(new, old, params, *_weights(rows.tokens.shape, 1))
  np.testing.assert_allclose(logp[:, 0], -np.log(61), rtol=1e-6)  # column 0 predicts nothing: uniform
  np.testing.assert_allclose(entropy[:, 0], np.log(61), rtol=1e-6)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_layout_runs_the_head_on_the_completion_columns_alone(name):
  """pack=False keeps each row as the engine lays it out, so the head starts at the first
  completion column: the completion tokens' logprobs, entropies and gradients are the whole
  vocabulary's, the prompt columns read zero."""
  policy, params = _model(name)
  batch = _batch([2, 4, 1, 3], [5, 2, 6, 4], p=4, c=6, vocab=61, seed=8)
  lay = packing.plan(batch.tokens, batch.valid, batch.loss_mask)
  rows, slot = _micro_batch(lay), jnp.asarray(lay.slot)
  assert lay.head_from == rows.head_from == 4 and rows.tokens.shape == (4, 10)
  mask = jnp.asarray(batch.loss_mask, jnp.float32)

  new = lambda p: tuple(from_layout(x, slot) for x in layout_logprobs(policy, p, rows, TEMP, chunk=4))
  old = lambda p: jax.tree.map(lambda x: x * mask, _whole_vocab_engine_logprobs(policy, p, batch, TEMP))
  _assert_same_and_same_gradients(new, old, params, *_weights(mask.shape, 9))
  assert not np.asarray(jnp.stack(layout_logprobs(policy, params, rows, TEMP)))[:, :, :4].any()


@pytest.mark.parametrize("name, pack", [(name, False) for name in CONFIGS] + [("tied", True)])
def test_shared_prompt_logprobs_match_unshared_whole_vocab(name, pack):
  policy, params = _model(name)
  batch = _batch([3, 3, 5, 5], [7, 4, 6, 2], p=5, c=7, vocab=61, seed=2)
  batch.tokens[1, :5], batch.tokens[3, :5] = batch.tokens[0, :5], batch.tokens[2, :5]
  lay = packing.plan(batch.tokens, batch.valid, batch.loss_mask, share_prompts=True, group_ids=np.array([0, 0, 1, 1]),
                     pack=pack, row_length=11)
  rows, slot = _micro_batch(lay), jnp.asarray(lay.slot)
  # packed: each group's two completions (7 + 4, 6 + 2 tokens) share a row of 11, each continuing its prompt
  assert rows.prompt_tokens is not None and rows.tokens.shape == ((4, 11) if pack else (4, 7))
  assert not pack or (np.asarray(rows.segments).max(1) == [2, 2, 0, 0]).all()
  mask = jnp.asarray(batch.loss_mask, jnp.float32)

  def new(p):  # chunks of 3 over C = 7: the last chunk padded
    logp, entropy = layout_logprobs(policy, p, rows, TEMP, chunk=3)
    return from_layout(logp, slot), from_layout(entropy, slot)

  old = lambda p: jax.tree.map(lambda x: x * mask, _whole_vocab_engine_logprobs(policy, p, batch, TEMP))
  _assert_same_and_same_gradients(new, old, params, *_weights(mask.shape, 3))


def test_token_logprobs_match_whole_vocab():
  policy, params = _model("untied_softcap")
  batch = _batch([2, 4, 1], [5, 3, 5], p=4, c=5, vocab=61, seed=4)
  real = lambda out: jax.tree.map(lambda x: jnp.where(batch.loss_mask, x, 0.0), out)  # as in the layout test
  new = lambda p: real(token_logprobs(policy, p, batch, TEMP, chunk=2))  # C = 5: 3 chunks of 2
  old = lambda p: real(_whole_vocab_engine_logprobs(policy, p, batch, TEMP))
  _assert_same_and_same_gradients(new, old, params, *_weights(batch.loss_mask.shape, 5))


@pytest.mark.parametrize("share_prompts", [False, True])
def test_critic_values_are_its_head_column_zero(share_prompts):
  policy, policy_params = _model("tied")
  critic = critic_model(policy)
  params = critic_init(critic, policy_params)
  params["lm_head"] = jax.random.normal(jax.random.key(6), params["lm_head"].shape)  # a trained head, not zeros
  batch = _batch([3, 3, 2, 2], [4, 2, 4, 3], p=3, c=4, vocab=61, seed=6)
  batch.tokens[1, :3], batch.tokens[3, :3] = batch.tokens[0, :3], batch.tokens[2, :3]
  lay = packing.plan(batch.tokens, batch.valid, batch.loss_mask, share_prompts=share_prompts,
                     group_ids=np.array([0, 0, 1, 1]))
  rows, slot = _micro_batch(lay), jnp.asarray(lay.slot)
  mask = jnp.asarray(batch.loss_mask, jnp.float32)
  weights = jax.random.normal(jax.random.key(7), mask.shape)

  def old(p):  # column 0 of the full head on the engine layout, at each completion token's state
    p_len = batch.tokens.shape[1] - mask.shape[1]
    positions = jnp.maximum(jnp.cumsum(batch.valid, axis=1) - 1, 0)
    logits, _ = critic.apply(p, batch.tokens[:, :-1], positions[:, :-1], causal_mask(batch.valid[:, :-1]))
    return logits[:, p_len - 1:, 0] * mask

  def with_grad(fn):
    return jax.jit(jax.value_and_grad(lambda p: (lambda v: ((weights * v).sum(), v))(fn(p)), has_aux=True))(params)

  (_, values), grads = with_grad(lambda p: from_layout(layout_values(critic, p, rows), slot))
  (_, old_values), old_grads = with_grad(old)
  assert np.abs(np.asarray(values)).max() > 0.1
  _assert_trees_close(values, old_values)
  _assert_trees_close(grads, old_grads)
  assert not np.asarray(grads["lm_head"])[:, 1:].any()  # only the value column learns


def _temp_bytes(fn, *args):
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_head_compiles_to_a_fraction_of_the_whole_vocab_temp_memory():
  """The gradient of the mean logprob of 4 rows x 512 tokens over an 8192 vocabulary, compiled
  (never run): the whole-vocab program holds several [R, L, V] fp32 arrays, the chunked one
  [R, 128, V] ones."""
  cfg = model_config(vocab_size=8192, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32, mlp_dim=128)
  policy = Policy.build(cfg)
  shape = jax.ShapeDtypeStruct((4, 512), jnp.int32)
  rows = Rows(tokens=shape, positions=shape, segments=shape, seq=shape)
  old = jax.grad(lambda p, r: _whole_vocab_layout_logprobs(policy, p, r)[0].mean())
  new = jax.grad(lambda p, r: layout_logprobs(policy, p, r, chunk=128)[0].mean())
  old_bytes, new_bytes = _temp_bytes(old, policy.shapes(), rows), _temp_bytes(new, policy.shapes(), rows)
  logits_bytes = 4 * 512 * 8192 * 4
  assert old_bytes > logits_bytes  # the whole [R, L, V] fp32 logits live at once
  assert new_bytes < 0.5 * old_bytes, (new_bytes, old_bytes)
