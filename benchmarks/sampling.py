"""What a decode step's draw costs (issue 20): rollout.sampling.sample as the engine calls it (a
runtime temperature, each row's uniform drawn beforehand) on [rows, vocab] fp32 logits, against,
in the same run:

  one pass      the logits' row maxima alone: one read of the logits, what any draw must do
  previous      sample as it was before session 29: one running sum over the whole vocabulary
                (XLA:CPU lowers cumsum as a tree of windowed sums), jnp.argmax for the greedy
                pick, the logprob taken from a [B, V] log_softmax: the same tokens and logprobs
  gumbel        jax.random.categorical with one key per row (Gumbel-max: Tunix's draw; with
                top-k, categorical over lax.top_k's values, as Tunix's top-k sampler)

The same again with top_k = 50: ours finds the cutoff by bisection among the tokens of the 50
blocks with the largest maxima; previous and gumbel by lax.top_k.

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
TOP_K = 50  # the truncated rows' top_k (lax.top_k sorts whole rows on XLA:CPU: few repeats)


def previous(logits, keys, temperature, top_k=0):
  """sample(logits, uniforms(keys), temperature, top_k) as it was before session 29."""
  greedy = temperature == 0.0
  scaled = logits / jnp.where(greedy, 1.0, temperature)
  logprobs = jax.nn.log_softmax(scaled, axis=-1)
  filtered = jnp.where(scaled < jax.lax.top_k(scaled, top_k)[0][..., -1:], -jnp.inf, scaled) if top_k else scaled
  running = jnp.cumsum(jnp.exp(filtered - jnp.max(filtered, axis=-1, keepdims=True)), axis=-1)
  u = uniforms(keys, logits.shape[0])[:, None] * running[:, -1:]
  token = jnp.minimum(jnp.sum(running <= u, axis=-1), logits.shape[-1] - 1).astype(jnp.int32)
  token = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), token)
  return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]


def gumbel_top_k(key, logits, top_k):
  """One row's Gumbel-max draw among its top_k logits (lax.top_k, then jax.random.categorical)."""
  values, tokens = jax.lax.top_k(logits, top_k)
  return tokens[jax.random.categorical(key, values)]


def programs(top_k=0):
  """name -> a jitted fn(logits [B, V], keys [B], temperature []) -> its outputs."""
  draw = lambda logits, keys, temperature: sample(logits, uniforms(keys, logits.shape[0]), temperature, top_k=top_k)
  if top_k:
    gumbel = lambda logits, keys, temperature: jax.vmap(gumbel_top_k, (0, 0, None))(keys, logits / temperature, top_k)
  else:
    gumbel = lambda logits, keys, temperature: jax.vmap(jax.random.categorical)(keys, logits / temperature)
  one_pass = lambda logits, keys, temperature: jnp.max(logits, axis=-1)
  return {
      "ours": jax.jit(draw),
      "previous": jax.jit(lambda logits, keys, temperature: previous(logits, keys, temperature, top_k)),
      "gumbel": jax.jit(gumbel),
      "one pass": jax.jit(one_pass)
  }


def measure(rows: int, vocab: int, repeats: int, top_k: int = 0) -> dict:
  logits = jax.random.normal(jax.random.key(0), (rows, vocab)) * 3
  keys = jax.random.split(jax.random.key(1), rows)
  temperature = jnp.float32(1.0)
  fns = programs(top_k)
  (ours, ours_lp), (before, before_lp) = (fns[k](logits, keys, temperature) for k in ("ours", "previous"))
  best = {name: float("inf") for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(logits, keys, temperature))
      best[name] = min(best[name], time.perf_counter() - start)
  return dict(rows=rows, vocab=vocab, top_k=top_k, seconds=best, same_tokens_as_previous=int(
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
    truncation = f", top-k {r['top_k']}" if r["top_k"] else ""
    lines.append(f"| {r['rows']} x {r['vocab']:,}{truncation} | {s['ours']:.3f} | {s['one pass']:.3f} | "
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
  for top_k in (0, TOP_K):
    for vocab in VOCABS:
      results.append(measure(args.rows, vocab, args.repeats if not top_k else max(3, args.repeats // 10), top_k))
      print(json.dumps(results[-1]), flush=True)
  from readme_section import report  # benchmarks/ is on the path when run as a script
  report(os.path.join(HERE, "out", "sampling.json"),
         dict(jax=jax.__version__, device=jax.devices()[0].platform, results=results), table(results), args.readme,
         "sampling", "A decode step's draw (benchmarks/sampling.py)")


if __name__ == "__main__":
  from jaxrl_hex.host_memory import restart_with_tunables
  restart_with_tunables()  # with glibc's tunables, as the jaxrl-hex program starts (jaxrl_hex/host_memory.py)
  main()
