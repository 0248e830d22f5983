"""First rollout engine: static batches, jitted prefill + KV-cached decode on the rollout mesh.

Layout shared with the trainer (rl.batch): prompts are left-padded to a bucket length P, so
every row's last prompt token sits at P-1 and the completion occupies cache slots P..P+C-1.
Positions count only real tokens, so padding never shifts RoPE.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hex.errors import UserError
from jaxrl_hex.models import init_cache
from jaxrl_hex.rollout.sampling import sample


@dataclasses.dataclass
class Rollout:
  """One generated batch (numpy, host side). N rows = prompts x group_size."""
  prompt_tokens: np.ndarray       # [N, P] int32, left-padded
  prompt_valid: np.ndarray        # [N, P] bool
  completion: np.ndarray          # [N, C] int32, pad after EOS
  completion_mask: np.ndarray     # [N, C] bool, real completion tokens (EOS included)
  behaviour_logprobs: np.ndarray  # [N, C] fp32
  versions: np.ndarray            # [N, C] int32, policy version that produced each token
  group_ids: np.ndarray           # [N] int64, one id per prompt
  rewards: np.ndarray | None = None  # [N] fp32

  @property
  def num_tokens(self) -> int:
    return int(self.completion_mask.sum())


def bucket(n: int, multiple: int = 8) -> int:
  return -(-n // multiple) * multiple


class Engine:
  """Generates completions on one pool. Never imports the trainer: weights arrive by load_weights."""

  def __init__(self, policy, pool, tokenizer, max_new_tokens: int, temperature=1.0, top_k=0, top_p=1.0):
    self.policy, self.pool, self.tokenizer = policy, pool, tokenizer
    self.max_new_tokens = max_new_tokens
    self.sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    self.param_shardings = pool.shardings_for(policy.logical_axes(), policy.shapes())
    self.version, self.params = -1, None
    self._compiled = {}

  def load_weights(self, version: int, params):
    self.version, self.params = version, params

  def encode_prompts(self, prompts: list[str], group_size: int):
    """Strings -> left-padded [len(prompts) * group_size, P] tokens and validity."""
    ids = [[self.tokenizer.bos_id] + self.tokenizer.encode(p) for p in prompts]
    p_len = bucket(max(map(len, ids)))
    tokens = np.full((len(ids), p_len), self.tokenizer.pad_id, np.int32)
    valid = np.zeros((len(ids), p_len), bool)
    for i, row in enumerate(ids):
      tokens[i, p_len - len(row):] = row
      valid[i, p_len - len(row):] = True
    return np.repeat(tokens, group_size, 0), np.repeat(valid, group_size, 0)

  def generate(self, prompts: list[str], group_size: int, rng, greedy=False, group_ids=None) -> Rollout:
    if self.params is None:
      raise RuntimeError("engine: no weights loaded; call load_weights(version, params) first")
    tokens, valid = self.encode_prompts(prompts, group_size)
    n = tokens.shape[0]
    if n % self.pool.batch_divisor:
      raise UserError(
          f"rollout batch of {n} sequences does not divide over pool '{self.pool.name}' "
          f"batch axes ({self.pool.batch_divisor} ways); make prompts x group_size a multiple of it")
    fn = self._generate_fn(tokens.shape, greedy)
    batch_sharding = self.pool.sharding(("batch", "length"))
    out = fn(self.params, jax.device_put(tokens, batch_sharding), jax.device_put(valid, batch_sharding),
             rng, jnp.int32(self.version))
    completion, mask, logprobs, versions = jax.device_get(out)
    if group_ids is None:
      group_ids = np.arange(len(prompts))
    return Rollout(tokens, valid, completion, mask, logprobs, versions,
                   np.repeat(np.asarray(group_ids), group_size))

  def decode(self, rollout: Rollout) -> list[str]:
    return [self.tokenizer.decode(row[m]) for row, m in zip(rollout.completion, rollout.completion_mask)]

  def _generate_fn(self, shape, greedy):
    key = (shape, greedy)
    if key not in self._compiled:
      sampling = dict(self.sampling, temperature=0.0) if greedy else self.sampling
      self._compiled[key] = jax.jit(
          functools.partial(_generate, self.policy, self.max_new_tokens, self.tokenizer.eos_id,
                            sampling, self.pool),
          in_shardings=(self.param_shardings, None, None, None, None))
    return self._compiled[key]


def _generate(policy, max_new, eos_id, sampling, pool, params, prompt, prompt_valid, rng, version):
  """Prefill the prompt, then decode until every row hit EOS or max_new tokens."""
  n, p_len = prompt.shape
  total = p_len + max_new
  cache_sharding = pool.sharding(("batch", "length", "kv_heads", "head_dim"))
  cache = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, cache_sharding),
                       init_cache(policy.cfg, n, total))
  key_valid = jnp.concatenate([prompt_valid, jnp.zeros((n, max_new), bool)], axis=1)  # [N, P+C]
  positions = jnp.maximum(jnp.cumsum(prompt_valid, axis=1) - 1, 0)
  prefill_mask = (jnp.arange(total)[None, :] <= jnp.arange(p_len)[:, None])[None] & key_valid[:, None, :]
  logits, cache = policy.apply(params, prompt, positions, prefill_mask, cache, 0)
  next_pos = positions[:, -1] + 1

  def body(state):
    t, logits, cache, key_valid, done, out_tok, out_lp, rng = state
    rng, step_rng = jax.random.split(rng)
    token, logprob = sample(logits, step_rng, **sampling)
    live = ~done
    token = jnp.where(live, token, 0)
    out_tok = out_tok.at[:, t].set(token)
    out_lp = out_lp.at[:, t].set(jnp.where(live, logprob, 0.0))
    key_valid = key_valid.at[:, p_len + t].set(live)
    done = done | (token == eos_id)
    step_mask = key_valid[:, None, :]  # [N, 1, P+C]: the new token sees all real keys so far
    logits, cache = policy.apply(params, token[:, None], (next_pos + t)[:, None], step_mask, cache, p_len + t)
    return t + 1, logits[:, -1], cache, key_valid, done, out_tok, out_lp, rng

  def cond(state):
    t, done = state[0], state[4]
    return (t < max_new) & ~jnp.all(done)

  init = (jnp.int32(0), logits[:, -1], cache, key_valid, jnp.zeros((n,), bool),
          jnp.zeros((n, max_new), jnp.int32), jnp.zeros((n, max_new), jnp.float32), rng)
  _, _, _, key_valid, _, tokens, logprobs, _ = jax.lax.while_loop(cond, body, init)
  mask = key_valid[:, p_len:]
  versions = jnp.where(mask, version, -1).astype(jnp.int32)
  return tokens, mask, logprobs, versions
