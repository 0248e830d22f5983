"""The train layout on the device: the records the model and the objectives read, and the model
run over them.

rl.packing lays a batch out on the host; the trainer puts the arrays the model reads on its pool
as `Rows` [M, K, R, L] (M minibatches, K micro-batches, R rows of L tokens), each sharded over the
pool axes its field declares; one micro-batch is the same record with [R, L] arrays. An
objective's per-token data (`TokenData`) shares that layout; `slot` [N, C] moves per-token values
between it and the [N, C] view of the batch (to_layout, from_layout).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl_hex.models.attention import Segments
from jaxrl_hex.models.decoder import extend_cache, init_cache, rope_tables

ROW_AXES = (None, None, "batch", "length")  # [M, K, R, L]: rows split over the batch axes
PROMPT_AXES = (None, None, None, "length")  # [M, K, G, P]: every shard holds all of its micro-batches' prompts


def _sharded(axes, optional=False):
  """A Rows field whose [M, K, ...] array the trainer shards over `axes`."""
  return dataclasses.field(metadata={"axes": axes}, **({"default": None} if optional else {}))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
  """The layout arrays the model reads, [M, K, R, L] or one micro-batch's [R, L]. The prompt
  fields are set only when rows are completions sharing their group's prompt (share_prompts)."""
  tokens: jax.Array = _sharded(ROW_AXES)  # [M, K, R, L] int32
  positions: jax.Array = _sharded(ROW_AXES)  # [M, K, R, L] int32, restart at 0 in every sequence
  segments: jax.Array = _sharded(ROW_AXES)  # [M, K, R, L] int32, 1.. per sequence within a row, 0 = padding
  seq: jax.Array = _sharded(ROW_AXES)  # [M, K, R, L] int32, index of the sequence in the batch, N = padding
  prompt_tokens: jax.Array | None = _sharded(PROMPT_AXES, optional=True)  # [M, K, G, P] int32, left-padded
  prompt_positions: jax.Array | None = _sharded(PROMPT_AXES, optional=True)  # [M, K, G, P] int32
  prompt_valid: jax.Array | None = _sharded(PROMPT_AXES, optional=True)  # [M, K, G, P] bool
  row_group: jax.Array | None = _sharded(ROW_AXES[:3], optional=True)  # [M, K, R] int32, the prompt a row continues


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenData:
  """An objective's per-token arrays in the layout of `Rows`, zero where no completion token
  lands; made once per step by its start(). SFT sets `weights` only; RL sets the optional fields
  its options need (None: that part of the loss is off)."""
  weights: jax.Array  # [M, K, R, L] fp32, loss weights (the aggregation, normalised within each minibatch)
  loss_mask: jax.Array | None = None  # [M, K, R, L] fp32, 1 on completion tokens
  behav_logp: jax.Array | None = None  # [M, K, R, L] fp32, the engine's logprob of each sampled token
  advantages: jax.Array | None = None  # [M, K, R, L] fp32
  metric_weights: jax.Array | None = None  # [M, K, R, L] fp32, token mean over the whole batch
  prox_logp: jax.Array | None = None  # [M, K, R, L] fp32, prox_logp='recompute' with several minibatches
  ref_logp: jax.Array | None = None  # [M, K, R, L] fp32, a frozen reference with kl_mode='loss'
  versions: jax.Array | None = None  # [M, K, R, L] int32, prox_logp='interpolate'
  old_values: jax.Array | None = None  # [M, K, R, L] fp32, the critic's values at the start of the step
  returns: jax.Array | None = None  # [M, K, R, L] fp32, the critic's regression targets


def _logprobs(logits, targets, temperature):
  """logits [.., T, V], targets [.., T] -> (logp [.., T], entropy [.., T]) at `temperature`.
  entropy = lse - sum(p * z): no second [.., T, V] array of log-probabilities."""
  z = logits / temperature
  lse = jax.nn.logsumexp(z, axis=-1)
  target = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
  return target - lse, lse - (jnp.exp(z - lse[..., None]) * z).sum(-1)


def chunked_logprobs(policy, params, hidden, targets, temperature=1.0, chunk=None):
  """Final hidden states [R, T, d_model] (policy.apply_hidden), targets [R, T] -> (logp [R, T],
  entropy [R, T]), the output head run over chunks of at most `chunk` positions (None: the
  model's logprob_chunk): peak memory O(R * chunk * V), not O(R * T * V). Each chunk is
  rematerialised in the backward pass, so the gradient keeps no chunk's logits either."""
  r, t = targets.shape
  n = -(-t // (chunk or policy.cfg.logprob_chunk))
  size = -(-t // n)  # equal chunks: at most n - 1 padded positions
  pad = n * size - t
  to_chunks = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(r, n, size, *x.shape[2:])
  xs = (to_chunks(hidden).swapaxes(0, 1), to_chunks(targets).swapaxes(0, 1))  # [n, R, size, d_model], [n, R, size]

  @functools.partial(jax.checkpoint, prevent_cse=False)  # in a scan, CSE cannot undo the remat
  def one(chunk_xs):
    h, y = chunk_xs
    return _logprobs(policy.logits(params, h), y, temperature)

  logp, entropy = jax.lax.map(one, xs)  # each [n, R, size]
  from_chunks = lambda x: x.swapaxes(0, 1).reshape(r, n * size)[:, :t]
  return from_chunks(logp), from_chunks(entropy)


def _rope(policy, limit: int) -> dict:
  """RoPE tables over positions 0..limit-1 (every position of the rows lies below limit), for
  the model to look its positions up in: computed from the positions inside the step, XLA fuses
  cos and sin into every layer's rotation of q and k, forward and backward, and evaluates them
  per element (3.6% of W3's train step on CPU)."""
  return rope_tables(policy.cfg, limit)


def token_logprobs(policy, params, batch, temperature=1.0, chunk=None):
  """A TrainBatch's rows as the engine lays them out -> (logp [N, C], entropy [N, C]) of each
  completion token."""
  tokens, valid = batch.tokens, batch.valid
  p_len = tokens.shape[1] - batch.loss_mask.shape[1]
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
  hidden, _ = policy.apply_hidden(params, tokens[:, :-1], positions[:, :-1],
                                  Segments.causal(valid[:, :-1], positions[:, :-1]),
                                  rope_tables=_rope(policy, tokens.shape[1]))
  return chunked_logprobs(policy, params, hidden[:, p_len - 1:], tokens[:, p_len:], temperature, chunk)


def shared_prompt_hidden(policy, params, rows: Rows):
  """Each of the micro-batch's G prompts [G, P] runs once; every completion row [R, C] attends to
  its group's prompt keys/values (gathered by row_group) and to its own earlier tokens.
  -> final hidden states [R, C, d_model] aligned to the completion tokens (token 0 from the
  prompt's last position)."""
  tokens, valid, group = rows.tokens, rows.segments > 0, rows.row_group
  p_valid = rows.prompt_valid
  g, p_len = p_valid.shape
  r, c_len = tokens.shape
  p_positions = rows.prompt_positions
  tables = _rope(policy, p_len + c_len)  # a completion's positions follow its prompt's
  prompt_hidden, cache = policy.apply_hidden(params, rows.prompt_tokens, p_positions,
                                             Segments.causal(p_valid, p_positions), init_cache(policy.cfg, g, p_len), 0,
                                             rope_tables=tables)
  cache = extend_cache(cache, group, c_len - 1)
  positions = rows.positions[:, :-1]
  # The prompt's positions precede the completion's, so causal order is position order.
  mask = Segments(valid[:, :-1].astype(jnp.int32), positions,
                  jnp.concatenate([p_valid[group], valid[:, :-1]], axis=1).astype(jnp.int32),
                  jnp.concatenate([p_positions[group], positions], axis=1))  # keys [R, P + C - 1]
  hidden, _ = policy.apply_hidden(params, tokens[:, :-1], positions, mask, cache, p_len, rope_tables=tables)
  return jnp.concatenate([prompt_hidden[group, -1:], hidden], axis=1)


def _layout_hidden(policy, params, rows: Rows):
  """The model on one micro-batch of rows [R, L], final hidden states [R, L, d_model] aligned to
  the tokens they predict: out[:, j] predicts token j (from position j - 1); column 0 predicts
  nothing and is zero, so its logits are 0 (with shared prompts, rows are completions and
  column 0 comes from the prompt)."""
  if rows.prompt_tokens is not None:
    return shared_prompt_hidden(policy, params, rows)
  hidden, _ = policy.apply_hidden(params, rows.tokens[:, :-1], rows.positions[:, :-1],
                                  Segments.causal(rows.segments[:, :-1], rows.positions[:, :-1]),
                                  rope_tables=_rope(policy, rows.tokens.shape[1]))  # positions restart in a row
  return jnp.pad(hidden, ((0, 0), (1, 0), (0, 0)))


def layout_logprobs(policy, params, rows: Rows, temperature=1.0, chunk=None):
  """-> (logp [R, L], entropy [R, L]) of every token given its prefix in its own sequence."""
  return chunked_logprobs(policy, params, _layout_hidden(policy, params, rows), rows.tokens, temperature, chunk)


def layout_values(critic, critic_params, rows: Rows):
  """The critic's value of the state each token is predicted from [R, L]: its head's column 0
  (a linear value head on the final hidden state), the only column computed."""
  return critic.logits(critic_params, _layout_hidden(critic, critic_params, rows), columns=slice(0, 1))[..., 0]


def over_layout(fn, rows: Rows):
  """fn(micro-batch Rows) -> [R, L] arrays, applied to every micro-batch of [M, K, R, L] rows."""
  m, k = rows.tokens.shape[:2]
  flat = jax.tree.map(lambda x: x.reshape(m * k, *x.shape[2:]), rows)
  return jax.tree.map(lambda y: y.reshape(m, k, *y.shape[1:]), jax.lax.map(fn, flat))


def to_layout(x, slot, shape):
  """[N, C] per-token values -> layout arrays of `shape` (zero where no completion token lands)."""
  size = functools.reduce(lambda a, b: a * b, shape)
  return jnp.zeros(size, x.dtype).at[slot.reshape(-1)].set(x.reshape(-1), mode="drop").reshape(shape)


def from_layout(x, slot):
  """Layout arrays -> [N, C] values at each completion token's slot (zero off the completion)."""
  return jnp.take(x.reshape(-1), slot, mode="fill", fill_value=0)
