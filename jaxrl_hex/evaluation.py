"""Held-out accuracy: mean reward of greedy completions (or of an environment's greedy episodes),
generated on whichever pool holds the weights; and for `jaxrl-hex eval` the rewards of k sampled
completions per prompt (pass@k, mean@k)."""
import jax
import numpy as np

from jaxrl_hex.rollout.streams import make_stream
from jaxrl_hex.tasks import is_episodic


def _padded(engine, chunk):
  return chunk + chunk[:1] * (-len(chunk) % engine.pool.batch_ways)  # the batch must split over the pool


def greedy_completions(engine, records, batch_size: int) -> list[str]:
  out = []
  for i in range(0, len(records), batch_size):
    chunk = records[i:i + batch_size]
    rollout = engine.generate([r["prompt"] for r in _padded(engine, chunk)], 1, jax.random.key(0), greedy=True)
    out += engine.decode(rollout)[:len(chunk)]
  return out


def sampled_completions(engine, records, k: int, rng, batch_size: int) -> list[list[str]]:
  """k completions of each record at the engine's temperature -> [record][sample]; chunk i's samples
  are keyed by fold_in(rng, i)."""
  out = []
  for i in range(0, len(records), batch_size):
    chunk = records[i:i + batch_size]
    rollout = engine.generate([r["prompt"] for r in _padded(engine, chunk)], k, jax.random.fold_in(rng, i))
    texts = engine.decode(rollout)  # prompt-major: a prompt's k samples are adjacent
    out += [texts[j * k:(j + 1) * k] for j in range(len(chunk))]
  return out


def greedy_episodes(stream, records, group_size: int = 1, rng=None) -> tuple:
  """An episodic task's episodes from the records through `stream` (rollout.streams.make_stream;
  kept by a caller that evaluates again and again, so its tool workers and endpoint start once),
  greedy (or sampled with `rng`) -> ([N] float32 rewards, the Episodes in row order: transcripts,
  faults)."""
  engine = stream.engine
  engine.greedy = rng is None
  try:
    rollout, episodes = stream.run(list(records), group_size, jax.random.key(0) if rng is None else rng)
  finally:
    engine.greedy = False
  return rollout.rewards, episodes


def rewards(scorer, records, completions) -> np.ndarray:
  """The task's reward of each record's completion -> [N] float32."""
  return scorer([r["prompt"] for r in records], completions, [r["answer"] for r in records])


def score(scorer, records, completions) -> float:
  return float(rewards(scorer, records, completions).mean())


def evaluate(engine, scorer, records, version, params, batch_size: int, task=None) -> float:
  """Greedy accuracy with these weights; an episodic `task` scores its own episodes (scorer unused)."""
  engine.load_weights(version, params)
  if is_episodic(task):
    stream = make_stream(engine, task)
    try:
      return float(greedy_episodes(stream, records)[0].mean())
    finally:
      stream.close()
  return score(scorer, records, greedy_completions(engine, records, batch_size))
