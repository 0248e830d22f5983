"""Advantage estimators: per-sequence scalars broadcast over completion tokens."""
import jax.numpy as jnp


def grpo(rewards, group_ids, eps: float = 1e-6):
  """Group-normalised: (r - mean_group) / (std_group + eps). rewards [N], group_ids [N]."""
  same = group_ids[:, None] == group_ids[None, :]              # [N, N]
  count = same.sum(1)
  mean = (same * rewards[None, :]).sum(1) / count
  var = (same * (rewards[None, :] - mean[:, None]) ** 2).sum(1) / count
  return (rewards - mean) / (jnp.sqrt(var) + eps)
