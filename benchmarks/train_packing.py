"""Packed vs padded micro-batches on a heavy-tailed length mix, and shared-prompt rows on a GRPO batch.

Packing: 128 sequences, prompts 8-32 tokens, completions log-normal (median 24, capped at 224),
the tiny Qwen3-like model of train_vs_tunix.py, micro-batches of 4096 token slots on the
4-device train pool. Same batch, same loss (tests/rl/test_trainer.py checks equal gradients);
train tokens/s counts real tokens.                       goal: >= 1.3x, packed padding share <= 5%

  python benchmarks/train_packing.py [--steps 3]  ->  benchmarks/out/train_packing.json
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
from train_vs_tunix import TINY, pools, trainer  # noqa: E402  (sets up 8 CPU devices)

from jaxrl_hex.config import base_config  # noqa: E402
from jaxrl_hex.models.config import model_config  # noqa: E402
from jaxrl_hex.models.policy import Policy  # noqa: E402
from jaxrl_hex.rl.batch import TrainBatch  # noqa: E402


def heavy_tailed_batch(n=128, p=32, c=224, seed=0):
  rng = np.random.default_rng(seed)
  prompt_lens = rng.integers(8, p + 1, n)
  completion_lens = np.clip(rng.lognormal(np.log(24), 0.9, n).astype(int), 1, c)
  tokens = rng.integers(3, 512, (n, p + c)).astype(np.int32)
  valid = np.zeros((n, p + c), bool)
  for i in range(n):
    valid[i, p - prompt_lens[i]:p + completion_lens[i]] = True
  loss_mask = valid[:, p:]
  return TrainBatch(tokens=tokens, valid=valid, loss_mask=loss_mask, behav_logp=np.where(loss_mask, -6.0,
                                                                                         0).astype(np.float32),
                    rewards=rng.normal(size=n).astype(np.float32),
                    group_ids=np.repeat(np.arange(n // 8), 8).astype(np.int32), versions=np.zeros((n, c), np.int32))


def measure(batch, steps, **layout):
  policy = Policy.build(model_config(**TINY))
  algo = base_config().algo
  algo.update(layout)
  tr = trainer(policy, pools()["train"], algo)
  first = tr.step(batch)
  runs = [tr.step(batch) for _ in range(steps)]
  best = max(runs, key=lambda m: m["train_tokens_per_s"])
  return {
      k: best[k]
      for k in ("train_tokens_per_s", "train_seconds", "padding_share", "micro_batches", "pack_rows", "shard_imbalance")
  } | {
      "first_step_s": first["train_seconds"]
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=3)
  args = ap.parse_args()
  batch = heavy_tailed_batch()
  lengths = batch.valid.sum(1)
  padded = measure(batch, args.steps, micro_batch_tokens=4096)
  packed = measure(batch, args.steps, micro_batch_tokens=4096, pack=True)
  ratio = packed["train_tokens_per_s"] / padded["train_tokens_per_s"]
  results = {
      "lengths": {
          "mean": float(lengths.mean()),
          "p50": float(np.median(lengths)),
          "max": int(lengths.max()),
          "real_tokens": int(lengths.sum())
      },
      "padded": padded,
      "packed": packed,
      "ratio_train_tokens_per_s": ratio
  }
  print(f"train tokens/s: padded {padded['train_tokens_per_s']:.0f} (padding {padded['padding_share']:.1%}), "
        f"packed {packed['train_tokens_per_s']:.0f} (padding {packed['padding_share']:.1%}) -> {ratio:.2f}x "
        "(goal >= 1.3x, padding <= 5%)")
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  with open(os.path.join(HERE, "out", "train_packing.json"), "w") as f:
    json.dump(results, f, indent=2)


if __name__ == "__main__":
  from jaxrl_hex.host_memory import restart_with_tunables
  restart_with_tunables()  # with glibc's tunables, as the jaxrl-hex program starts (jaxrl_hex/host_memory.py)
  main()
