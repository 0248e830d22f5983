"""Train batches: the trainer's view of rollouts and SFT records, in the engine's layout.

tokens [N, P + C] = left-padded prompt ++ completion; valid marks real tokens; the loss covers
the last C positions (loss_mask [N, C]).
"""
import dataclasses

import numpy as np

from jaxrl_hex.rollout.engine import Rollout, bucket


def rl_batch(rollout: Rollout) -> dict:
  if rollout.rewards is None:
    raise ValueError("rl_batch: rollout has no rewards; score it before training on it")
  return {
      "tokens": np.concatenate([rollout.prompt_tokens, rollout.completion], 1),
      "valid": np.concatenate([rollout.prompt_valid, rollout.completion_mask], 1),
      "loss_mask": rollout.completion_mask,
      "behav_logp": rollout.behaviour_logprobs,
      "rewards": rollout.rewards.astype(np.float32),
      "group_ids": rollout.group_ids.astype(np.int32),
      "versions": rollout.versions.astype(np.int32),
  }


def select_rows(rollout: Rollout, rows) -> Rollout:
  """The rollout restricted to `rows` (indices), every per-row field alike."""
  return dataclasses.replace(rollout, **{
      f.name: getattr(rollout, f.name)[rows] for f in dataclasses.fields(rollout)
      if getattr(rollout, f.name) is not None})


def concat_rollouts(rollouts: list[Rollout]) -> Rollout:
  """Rows of several rollouts in one; prompts are left-padded again to the widest."""
  width = max(r.prompt_tokens.shape[1] for r in rollouts)
  fields = {}
  for f in dataclasses.fields(Rollout):
    parts = [getattr(r, f.name) for r in rollouts]
    if any(p is None for p in parts):
      continue
    if f.name in ("prompt_tokens", "prompt_valid"):  # padding is invalid, its value never read
      parts = [np.pad(p, ((0, 0), (width - p.shape[1], 0))) for p in parts]
    fields[f.name] = np.concatenate(parts)
  return Rollout(**fields)


def sft_batch(tokenizer, records: list[dict]) -> dict:
  """Teacher forcing on answer + EOS, prompts laid out as the engine lays them out."""
  prompts = [[tokenizer.bos_id] + tokenizer.encode(r["prompt"]) for r in records]
  answers = [tokenizer.encode(r["answer"]) + [tokenizer.eos_id] for r in records]
  p_len, c_len = bucket(max(map(len, prompts))), bucket(max(map(len, answers)))
  n = len(records)
  tokens = np.full((n, p_len + c_len), tokenizer.pad_id, np.int32)
  valid = np.zeros((n, p_len + c_len), bool)
  for i, (p, a) in enumerate(zip(prompts, answers)):
    tokens[i, p_len - len(p):p_len] = p
    tokens[i, p_len:p_len + len(a)] = a
    valid[i, p_len - len(p):p_len + len(a)] = True
  return {"tokens": tokens, "valid": valid, "loss_mask": valid[:, p_len:]}
