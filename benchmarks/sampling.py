"""What a decode step's draw costs (issue 20): rollout.sampling.sample as the engine calls it (a
runtime temperature, each row's uniform drawn beforehand) on [rows, vocab] fp32 logits, against,
in the same run:

  one pass      the logits' row maxima alone: one read of the logits, what any draw must do
  previous      sample as it was before session 29: one running sum over the whole vocabulary
                (XLA:CPU lowers cumsum as a tree of windowed sums), jnp.argmax for the greedy
                pick, the logprob taken from a [B, V] log_softmax: the same tokens and logprobs
  gumbel        jax.random.categorical with one key per row (Gumbel-max: Tunix's draw)

Vocabularies: 512 (benchmarks/rollout.py's model), 32,768 and 151,936 (Qwen3's). Each program is
jitted alone and timed best of `--repeats` calls, the programs alternating within each round.

  taskset -c 1 python benchmarks/sampling.py [--rows 32] [--repeats 30] [--readme]  ->  benchmarks/out/sampling.json
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_hex.rollout.sampling import sample, uniforms  # noqa: E402

VOCABS = (512, 32768, 151936)


def previous(logits, keys, temperature):
  """sample(logits, uniforms(keys), temperature) as it was before session 29 (no truncation)."""
  greedy = temperature == 0.0
  scaled = logits / jnp.where(greedy, 1.0, temperature)
  logprobs = jax.nn.log_softmax(scaled, axis=-1)
  running = jnp.cumsum(jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), axis=-1)
  u = uniforms(keys, logits.shape[0])[:, None] * running[:, -1:]
  token = jnp.minimum(jnp.sum(running <= u, axis=-1), logits.shape[-1] - 1).astype(jnp.int32)
  token = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), token)
  return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]


def programs():
  """name -> a jitted fn(logits [B, V], keys [B], temperature []) -> its outputs."""
  draw = lambda logits, keys, temperature: sample(logits, uniforms(keys, logits.shape[0]), temperature)

  gumbel = lambda logits, keys, temperature: jax.vmap(jax.random.categorical)(keys, logits / temperature)
  one_pass = lambda logits, keys, temperature: jnp.max(logits, axis=-1)
  return {
      "ours": jax.jit(draw),
      "previous": jax.jit(previous),
      "gumbel": jax.jit(gumbel),
      "one pass": jax.jit(one_pass)
  }


def measure(rows: int, vocab: int, repeats: int) -> dict:
  logits = jax.random.normal(jax.random.key(0), (rows, vocab)) * 3
  keys = jax.random.split(jax.random.key(1), rows)
  temperature = jnp.float32(1.0)
  fns = programs()
  (ours, ours_lp), (before, before_lp) = (fns[k](logits, keys, temperature) for k in ("ours", "previous"))
  best = {name: float("inf") for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(logits, keys, temperature))
      best[name] = min(best[name], time.perf_counter() - start)
  return dict(rows=rows, vocab=vocab, seconds=best, same_tokens_as_previous=int(
      (ours == before).sum()), logprob_max_abs_diff=float(jnp.max(jnp.abs(ours_lp - before_lp))),
              ours_over_one_pass=best["ours"] / best["one pass"], previous_over_ours=best["previous"] / best["ours"],
              gumbel_over_ours=best["gumbel"] / best["ours"])


def table(results) -> str:
  lines = [
      "| rows x vocab | ours (ms) | one pass (ms) | **ours / one pass** | previous (ms) | previous / ours | "
      "gumbel (ms) | gumbel / ours | same tokens as previous | logprobs' largest difference |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results:
    s = {k: v * 1e3 for k, v in r["seconds"].items()}
    lines.append(f"| {r['rows']} x {r['vocab']:,} | {s['ours']:.3f} | {s['one pass']:.3f} | "
                 f"**{r['ours_over_one_pass']:.1f}x** | {s['previous']:.3f} | {r['previous_over_ours']:.1f}x | "
                 f"{s['gumbel']:.3f} | {r['gumbel_over_ours']:.1f}x | {r['same_tokens_as_previous']} / {r['rows']} | "
                 f"{r['logprob_max_abs_diff']:.1e} |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=30)
  ap.add_argument("--readme", action="store_true", help="write the table into benchmarks/README.md")
  args = ap.parse_args()
  results = []
  for vocab in VOCABS:
    results.append(measure(args.rows, vocab, args.repeats))
    print(json.dumps(results[-1]), flush=True)
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  with open(os.path.join(HERE, "out", "sampling.json"), "w") as f:
    json.dump(dict(jax=jax.__version__, device=jax.devices()[0].platform, results=results), f, indent=2)
  print(table(results))
  if args.readme:
    from readme_section import write_section
    write_section("sampling", table(results), "A decode step's draw (benchmarks/sampling.py)")


if __name__ == "__main__":
  main()
