"""Generated batches on the host: the record the rollout engine produces and the trainer, the
buffer and dynamic sampling read, so neither side imports the other."""
import dataclasses

import numpy as np


@dataclasses.dataclass
class Rollout:
  """One generated batch (numpy, host side). N rows = prompts x group_size. An episode of an
  environment (rollout/episodes.py) is one row: its completion holds every token after its first
  prompt, the model's turns (completion_mask: trained) and the observations between them
  (context_mask: context only), and the episode fields count what happened in it."""
  prompt_tokens: np.ndarray  # [N, P] int32, left-padded
  prompt_valid: np.ndarray  # [N, P] bool
  completion: np.ndarray  # [N, C] int32, pad after EOS
  completion_mask: np.ndarray  # [N, C] bool, real completion tokens (EOS included)
  behaviour_logprobs: np.ndarray  # [N, C] fp32
  versions: np.ndarray  # [N, C] int32, policy version that produced each token
  group_ids: np.ndarray  # [N] int64, one id per prompt
  rewards: np.ndarray | None = None  # [N] fp32
  truncated: np.ndarray | None = None  # [N] bool, stopped by the token budget
  context_mask: np.ndarray | None = None  # [N, C] bool: observation tokens between an episode's turns
  turns: np.ndarray | None = None  # [N] int32: the model's turns in the episode
  tool_calls: np.ndarray | None = None  # [N] int32
  tool_errors: np.ndarray | None = None  # [N] int32: calls that returned an error observation
  faults: np.ndarray | None = None  # [N] int32: 1 where the episode ended on a fault (env error, token limit)

  @property
  def completion_valid(self) -> np.ndarray:
    """[N, C] bool: every real token after the prompt (the model's and the observations')."""
    return self.completion_mask if self.context_mask is None else self.completion_mask | self.context_mask

  @property
  def num_tokens(self) -> int:
    return int(self.completion_mask.sum())

  def oldest_versions(self) -> np.ndarray:
    """[N] int32: the oldest policy version among each sample's tokens."""
    return np.where(self.completion_mask, self.versions, np.iinfo(np.int32).max).min(axis=1)


def bucket(n: int, multiple: int = 8) -> int:
  return -(-n // multiple) * multiple


def encode_prompts(tokenizer, prompts: list):
  """Strings (or token ids, taken as they are) -> (token ids per prompt, BOS first; tokens [n, P]
  int32 left-padded to a multiple of 8; valid [n, P] bool). The one prompt layout: the engine's
  batches and SFT batches use it."""
  ids = [[tokenizer.bos_id] + tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
  p_len = bucket(max(map(len, ids)))
  tokens = np.full((len(ids), p_len), tokenizer.pad_id, np.int32)
  valid = np.zeros((len(ids), p_len), bool)
  for i, row in enumerate(ids):
    tokens[i, p_len - len(row):] = row
    valid[i, p_len - len(row):] = True
  return ids, tokens, valid


def decode_completions(tokenizer, rollout: Rollout) -> list[str]:
  """Each row's completion as text (its masked tokens)."""
  return [tokenizer.decode(row[m]) for row, m in zip(rollout.completion, rollout.completion_mask)]


def select_rows(rollout: Rollout, rows) -> Rollout:
  """The rollout restricted to `rows` (indices), every per-row field alike."""
  return dataclasses.replace(
      rollout, **{
          f.name: getattr(rollout, f.name)[rows] for f in dataclasses.fields(rollout)
          if getattr(rollout, f.name) is not None
      })


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
