"""Paged KV cache vs max-length reservation on a long-tailed workload, in the same KV memory.

A scaled-down AReaL-Hex rollout: groups of `--group` samples, new-token budgets drawn per group
from a lognormal (mean ~`--mean` tokens, clipped at 4x the mean; EOS is unreachable, so the
budget is a sequence's length). Both engines get the same KV memory: the contiguous engine `--slots` rows of
prompt + 4 x mean tokens; the paged engine a pool of the same bytes in blocks of `--page` tokens
and 4x the slots, so blocks, not slots, bound what it runs. Reports sequences in flight per
decode step (mean = tokens / steps; max = the most live in one hand-back), new tokens per second
(best of --repeats warm runs after a cold one) and the paged engine's preemptions.

  python benchmarks/paged_kv.py            # ~3 min on 2 cores; benchmarks/out/paged_kv.json + README table
"""
import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import rollout as bench  # noqa: E402  (the rollout benchmark's model and tokenizer)

COMMAND = "python benchmarks/paged_kv.py"


def workload(prompts: int, group: int, mean: int, prompt_len: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  sigma = 1.0  # a group's samples share a Request and so its budget: the tail is over groups
  budgets = np.clip(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, prompts), 1, 4 * mean).astype(int)
  budgets = np.repeat(budgets, group)
  ids = np.concatenate(
      [np.full((prompts, 1), bench.BOS),
       rng.integers(3, bench.MODEL["vocab_size"], (prompts, prompt_len - 1))], 1)
  return dict(prompts=ids.astype(np.int32), group=group, budgets=budgets.tolist(), max_new=4 * mean)


def run_engine(w, slots: int, page: int, blocks: int, steps_per_sync: int, repeats: int) -> dict:
  import jax

  from jaxrl_hex.rollout.engine import Engine, Request
  pool, policy, params = bench._our_policy()
  engine = Engine(policy, pool, bench.IntTokenizer(), w["max_new"], temperature=1.0, slots=slots,
                  max_prompt_len=w["prompts"].shape[1], eos_ids=(bench.EOS,), steps_per_sync=steps_per_sync,
                  kv_page_size=page, kv_blocks=blocks)
  engine.load_weights(0, params)
  g = w["group"]

  def run(seed):
    engine.rng = jax.random.key(seed)
    engine.submit([Request(p.tolist(), n=g, max_tokens=w["budgets"][i * g]) for i, p in enumerate(w["prompts"])])
    steps0, tokens0, peak, samples = engine.decode_steps, engine.tokens_generated, 0, []
    t0 = time.perf_counter()
    while engine.pending:
      done = engine.poll()
      peak = max(peak, engine.num_slots - engine.free_slots + len(done))  # live through that hand-back
      samples += done
    seconds = time.perf_counter() - t0
    tokens = engine.tokens_generated - tokens0
    assert tokens == sum(len(s.tokens) for s in samples) == sum(w["budgets"]), tokens
    return dict(seconds=seconds, new_tokens=tokens, mean_in_flight=tokens / (engine.decode_steps - steps0),
                max_in_flight=peak)

  run(0)  # cold: compiles
  best = min((run(i + 1) for i in range(repeats)), key=lambda r: r["seconds"])
  return dict(best, slots=slots, kv_page_size=page, kv_blocks=engine.layout.blocks,
              new_tokens_per_s=best["new_tokens"] / best["seconds"], kv_cache_bytes=engine.memory["kv_cache_bytes"],
              preemptions=engine.preemptions, compile_count=engine.compile_count)


def table(w, ring, paged) -> str:
  rows = [
      f"`{COMMAND}`: {len(w['budgets'])} sequences ({len(w['prompts'])} prompts x {w['group']} samples, prompts of "
      f"{w['prompts'].shape[1]} tokens), new tokens mean {np.mean(w['budgets']):.0f} / max {max(w['budgets'])} "
      f"(lognormal, clipped at {w['max_new']}); both engines hold {ring['kv_cache_bytes'] / 2**20:.1f} MiB of KV.", "",
      "| KV cache | slots | KV memory | in flight mean / max | new tok/s | preemptions |", "|---|---|---|---|---|---|"
  ]
  for name, r in (("contiguous (max-length rows)", ring), (f"paged ({r_blocks(paged)})", paged)):
    rows.append(f"| {name} | {r['slots']} | {r['kv_cache_bytes'] / 2**20:.1f} MiB | {r['mean_in_flight']:.1f} / "
                f"{r['max_in_flight']} | {r['new_tokens_per_s']:.0f} | {r['preemptions']} |")
  rows += [
      "", f"Paged / contiguous: {paged['mean_in_flight'] / ring['mean_in_flight']:.2f}x sequences in flight (mean), "
      f"{paged['new_tokens_per_s'] / ring['new_tokens_per_s']:.2f}x new tokens/s."
  ]
  return "\n".join(rows)


def r_blocks(r) -> str:
  return f"{r['kv_blocks']} blocks x {r['kv_page_size']} tokens"


def main():
  from readme_section import write_section  # benchmarks/ is on the path when run as a script
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--group", type=int, default=4)
  ap.add_argument("--mean", type=int, default=48, help="mean new tokens; the longest budget is 4x")
  ap.add_argument("--prompt-len", type=int, default=8)
  ap.add_argument("--slots", type=int, default=16, help="the contiguous engine's slots; the paged one gets 4x")
  ap.add_argument("--page", type=int, default=4)
  ap.add_argument("--steps-per-sync", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--json", default=os.path.join(HERE, "out", "paged_kv.json"))
  args = ap.parse_args()
  w = workload(args.prompts, args.group, args.mean, args.prompt_len)
  length = args.prompt_len + w["max_new"]
  ring = run_engine(w, args.slots, 0, 0, args.steps_per_sync, args.repeats)
  blocks = args.slots * -(-length // args.page)  # the contiguous cache's memory, in blocks
  paged = run_engine(w, 4 * args.slots, args.page, blocks, args.steps_per_sync, args.repeats)
  assert ring["kv_cache_bytes"] == paged["kv_cache_bytes"], (ring, paged)
  text = table(w, ring, paged)
  print(text)
  write_section("paged-kv", text, "Paged KV cache (benchmarks/paged_kv.py)")
  os.makedirs(os.path.dirname(args.json), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(dict(workload={k: v for k, v in w.items() if k != "prompts"}, contiguous=ring, paged=paged), f, indent=2)


if __name__ == "__main__":
  main()
