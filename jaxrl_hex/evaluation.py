"""Held-out accuracy: mean reward of greedy completions, generated on whichever pool holds the weights."""
import jax
import numpy as np


def evaluate(engine, scorer, records, version, params, batch_size: int) -> float:
  engine.load_weights(version, params)
  ways = engine.pool.batch_divisor
  rewards = []
  for i in range(0, len(records), batch_size):
    chunk = records[i:i + batch_size]
    padded = chunk + chunk[:1] * (-len(chunk) % ways)  # the batch must split over the pool
    rollout = engine.generate([r["prompt"] for r in padded], 1, jax.random.key(0), greedy=True)
    completions = engine.decode(rollout)[:len(chunk)]
    rewards.append(scorer([r["prompt"] for r in chunk], completions, [r["answer"] for r in chunk]))
  return float(np.concatenate(rewards).mean())
