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

from jaxrl_hex.models.attention import SHARED, Segments
from jaxrl_hex.models.decoder import PrefixKV, head_logits, rope_tables

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
  # Static: no token before this column is a loss token (rows laid out as the engine lays out a
  # batch, prompt then completion), so the output head runs from it on.
  head_from: int = dataclasses.field(default=0, metadata={"static": True})


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
  """fp32 logits [.., V], targets [..] -> (logp, entropy, lse) [..] of softmax(z), z = logits /
  temperature, as the engine takes its logprob (rollout.sampling.picked_logprobs: shifted by the
  max, less the log of the shifted exps' sum). Every [.., V] term is read from the logits as they
  lie, so no scaled or shifted copy of them is written: entropy = log(sum) - sum(e * shifted) / sum,
  e = exp(shifted)."""
  scale = 1.0 / temperature
  top = logits.max(-1, keepdims=True)
  shifted = (logits - top) * scale
  e = jnp.exp(shifted)
  total = e.sum(-1)
  norm = jnp.log(total)
  logp = jnp.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0] - norm
  return logp, norm - (e * shifted).sum(-1) / total, top[..., 0] * scale + norm


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def head_logprobs(hidden, head, targets, temperature, cap):
  """Hidden states [.., d_model] through the output head [d_model, V] (decoder.head_logits,
  soft-capped at cap), targets [..] -> (logp, entropy) [..] at `temperature`.

  The backward pass recomputes the logits (nothing [.., V] is kept) and forms their gradient in
  one elementwise pass, with z = logits / temperature and p = softmax(z): d logp / dz = onehot - p,
  d entropy / dz = -p (z - lse + entropy). Left to autodiff, XLA:CPU scattered the target's
  gradient into a [.., V] array and transposed the whole logits gradient for the head's."""
  return _logprobs(head_logits(hidden, head, cap), targets, temperature)[:2]


def _head_forward(hidden, head, targets, temperature, cap):
  logp, entropy, lse = _logprobs(head_logits(hidden, head, cap), targets, temperature)
  return (logp, entropy), (hidden, head, targets, lse, entropy)


def _head_backward(temperature, cap, residuals, cotangents):
  hidden, head, targets, lse, entropy = residuals
  d_logp, d_entropy = (c[..., None] for c in cotangents)
  logits = head_logits(hidden, head, cap)
  centred = logits * (1.0 / temperature) - lse[..., None]  # log p
  p = jnp.exp(centred)
  target = jnp.arange(logits.shape[-1]) == targets[..., None]
  dz = jnp.where(target, d_logp, 0.0) - p * (d_logp + d_entropy * (centred + entropy[..., None]))
  d_raw = dz * (1.0 / temperature)
  if cap:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
    d_raw = d_raw * (1.0 - jnp.square(logits / cap))
  # fp32 against the head's dtype, accumulated in fp32, as autodiff transposes head_logits' matmul
  d_flat, h_flat = d_raw.reshape(-1, logits.shape[-1]), hidden.reshape(-1, hidden.shape[-1])
  dot = lambda a, b, contract: jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)
  d_hidden = dot(d_flat, head, ((1,), (1,))).reshape(hidden.shape)
  d_head = dot(h_flat, d_flat, ((0,), (0,)))  # contracting d_raw's rows as it lies: no transpose of it
  return d_hidden.astype(hidden.dtype), d_head.astype(head.dtype), None


head_logprobs.defvjp(_head_forward, _head_backward)


def chunked_logprobs(policy, params, hidden, targets, temperature=1.0, chunk=None):
  """Final hidden states [R, T, d_model] (policy.apply_hidden), targets [R, T] -> (logp [R, T],
  entropy [R, T]), the output head run over chunks of at most `chunk` positions (None: the
  model's logprob_chunk): peak memory O(R * chunk * V), not O(R * T * V). Each chunk's logits
  are recomputed in the backward pass (head_logprobs), so the gradient keeps no chunk's either."""
  r, t = targets.shape
  n = -(-t // (chunk or policy.cfg.logprob_chunk))
  size = -(-t // n)  # equal chunks: at most n - 1 padded positions
  pad = n * size - t
  to_chunks = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(r, n, size, *x.shape[2:])
  xs = (to_chunks(hidden).swapaxes(0, 1), to_chunks(targets).swapaxes(0, 1))  # [n, R, size, d_model], [n, R, size]
  head, cap = policy.module(params).head(), policy.cfg.final_logit_softcap
  logp, entropy = jax.lax.map(lambda chunk_xs: head_logprobs(chunk_xs[0], head, chunk_xs[1], temperature, cap), xs)
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
  its group's prompt keys/values (gathered by row_group) and to its own earlier tokens. A row may
  hold several completions (packed: segment ids 1.., positions each continuing the prompt's).
  -> final hidden states [R, C, d_model] aligned to the completion tokens (each completion's
  first token from the prompt's last position)."""
  tokens, segments, group = rows.tokens, rows.segments, rows.row_group
  p_valid, p_positions = rows.prompt_valid, rows.prompt_positions
  tables = _rope(policy, p_valid.shape[1] + tokens.shape[1])  # a completion's positions follow its prompt's
  prompt_hidden, cache = policy.apply_hidden(params, rows.prompt_tokens, p_positions,
                                             Segments.causal(p_valid, p_positions), None, PrefixKV(),
                                             rope_tables=tables)
  positions, ids = rows.positions[:, :-1], segments[:, :-1]
  # The prompt's positions precede the completions', so causal order is position order.
  mask = Segments(ids, positions, jnp.concatenate([jnp.where(p_valid[group], SHARED, 0), ids], axis=1),
                  jnp.concatenate([p_positions[group], positions], axis=1))  # keys [R, P + C - 1]
  hidden, _ = policy.apply_hidden(params, tokens[:, :-1], positions, mask, cache, PrefixKV(group), rope_tables=tables)
  last = prompt_hidden[group, -1:]
  first = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
  return jnp.where(first[..., None], last, jnp.concatenate([last, hidden], axis=1))


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
  """-> (logp [R, L], entropy [R, L]) of every token from column rows.head_from on given its
  prefix in its own sequence; zero before it."""
  start = rows.head_from
  hidden = _layout_hidden(policy, params, rows)[:, start:]
  out = chunked_logprobs(policy, params, hidden, rows.tokens[:, start:], temperature, chunk)
  return tuple(jnp.pad(x, ((0, 0), (start, 0))) for x in out)


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
