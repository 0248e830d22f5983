"""Held-out accuracy: mean reward of greedy completions, generated on whichever pool holds the weights."""
import jax


def greedy_completions(engine, records, batch_size: int) -> list[str]:
  ways = engine.pool.batch_ways
  out = []
  for i in range(0, len(records), batch_size):
    chunk = records[i:i + batch_size]
    padded = chunk + chunk[:1] * (-len(chunk) % ways)  # the batch must split over the pool
    rollout = engine.generate([r["prompt"] for r in padded], 1, jax.random.key(0), greedy=True)
    out += engine.decode(rollout)[:len(chunk)]
  return out


def score(scorer, records, completions) -> float:
  return float(scorer([r["prompt"] for r in records], completions, [r["answer"] for r in records]).mean())


def evaluate(engine, scorer, records, version, params, batch_size: int) -> float:
  engine.load_weights(version, params)
  return score(scorer, records, greedy_completions(engine, records, batch_size))
