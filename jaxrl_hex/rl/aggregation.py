"""Loss aggregation as per-token weights: loss = sum(weight * per_token_loss).

The weights are computed once per step on the whole batch ([N, C] rows), before it is cut into
micro-batches, so gradient accumulation and sequence packing give exactly the full-batch loss:
a micro-batch contributes sum(weight * loss) over its own tokens.

  token-mean               every token of the batch counts the same (DAPO)
  seq-mean-token-mean      mean over tokens within a sequence, then over sequences (GRPO)
  seq-mean-token-sum-norm  token sums divided by a constant length, mean over sequences (Dr. GRPO)

An aggregation maps (mask [N, C] fp32, algo) -> weights [N, C]; sequences with an all-zero mask
do not count. Register your own with @AGGREGATIONS.register("name").
"""
import jax.numpy as jnp

from jaxrl_hex.rl.registry import Registry

AGGREGATIONS = Registry("loss aggregation", "algo.loss_agg")


def _num_seqs(mask):
  return jnp.maximum((mask.sum(1) > 0).sum(), 1)


@AGGREGATIONS.register("token-mean")
def token_mean(mask, algo):
  return mask / jnp.maximum(mask.sum(), 1)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(mask, algo):
  return mask / jnp.maximum(mask.sum(1, keepdims=True), 1) / _num_seqs(mask)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(mask, algo):
  """Divides by algo.loss_norm_length (0 = the completion width C, i.e. max_new_tokens)."""
  norm = algo.loss_norm_length or mask.shape[1]
  return mask / norm / _num_seqs(mask)


def minibatch_weights(aggregate, mask, minibatch_of, num_minibatches: int, algo):
  """Weights normalised within each minibatch (one optimizer update each). minibatch_of [N]."""
  return sum(aggregate(mask * (minibatch_of == m)[:, None], algo) for m in range(num_minibatches))
