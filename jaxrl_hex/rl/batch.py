"""Train batches: the trainer's view of rollouts and SFT records, in the engine's layout.

tokens [N, P + C] = left-padded prompt ++ completion; valid marks real tokens; the loss covers
the last C positions (loss_mask [N, C]), an episode's observations there excluded.
"""
import dataclasses

import jax
import numpy as np

from jaxrl_hex.data.rollouts import Rollout, bucket, encode_prompts
from jaxrl_hex.tasks import demonstration, is_episodic


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
  """N sequences, numpy on the host. A pytree: the trainer's start pass takes its per-sequence
  fields on the pool (the model reads tokens through the layout). SFT leaves the RL fields None."""
  tokens: np.ndarray  # [N, P + C] int32
  valid: np.ndarray  # [N, P + C] bool
  loss_mask: np.ndarray  # [N, C] bool
  behav_logp: np.ndarray | None = None  # [N, C] fp32, the engine's logprob of each sampled token
  rewards: np.ndarray | None = None  # [N] fp32
  group_ids: np.ndarray | None = None  # [N] int32, samples of one prompt share an id
  versions: np.ndarray | None = None  # [N, C] int32, policy version that sampled each token


def scoring_batch(rollout: Rollout) -> TrainBatch:
  """The rollout's rows as sequences to score (prompt ++ completion), without the RL fields."""
  return TrainBatch(tokens=np.concatenate([rollout.prompt_tokens, rollout.completion],
                                          1), valid=np.concatenate([rollout.prompt_valid, rollout.completion_valid], 1),
                    loss_mask=rollout.completion_mask)


def rl_batch(rollout: Rollout) -> TrainBatch:
  if rollout.rewards is None:
    raise ValueError("rl_batch: rollout has no rewards; score it before training on it")
  return dataclasses.replace(scoring_batch(rollout), behav_logp=rollout.behaviour_logprobs,
                             rewards=rollout.rewards.astype(np.float32), group_ids=rollout.group_ids.astype(np.int32),
                             versions=rollout.versions.astype(np.int32))


def sft_batch(tokenizer, records: list[dict], task=None) -> TrainBatch:
  """Teacher forcing on answer + EOS, prompts laid out as the engine lays them out; an
  episodic `task` teaches its demonstration episodes (the model's turns, observations as context)."""
  if is_episodic(task):
    prompts, rest, by_model = zip(*(demonstration(task, r) for r in records))
  else:
    prompts = [r["prompt"] for r in records]
    rest = [tokenizer.encode(r["answer"]) + [tokenizer.eos_id] for r in records]
    by_model = [[True] * len(a) for a in rest]
  _, prompt_tokens, prompt_valid = encode_prompts(tokenizer, list(prompts))
  n, p_len, c_len = len(records), prompt_tokens.shape[1], bucket(max(map(len, rest)))
  tokens = np.concatenate([prompt_tokens, np.full((n, c_len), tokenizer.pad_id, np.int32)], 1)
  valid = np.concatenate([prompt_valid, np.zeros((n, c_len), bool)], 1)
  loss_mask = np.zeros((n, c_len), bool)
  for i, (a, m) in enumerate(zip(rest, by_model)):
    tokens[i, p_len:p_len + len(a)] = a
    valid[i, p_len:p_len + len(a)] = True
    loss_mask[i, :len(a)] = m
  return TrainBatch(tokens=tokens, valid=valid, loss_mask=loss_mask)
