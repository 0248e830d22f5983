"""Paged KV cache vs max-length reservation on a long-tailed workload, in the same KV memory.

A scaled-down AReaL-Hex rollout, shaped as meshes/cluster-v5p-h100.yaml's workload (output
lengths lognormal with its sigma, clipped at its max / mean ratio, prompts of its prompt / mean
ratio) at `--mean` new tokens: groups of `--group` samples, each group's budget drawn from that
distribution (EOS is unreachable, so the budget is a sequence's length). Both engines get the
same KV memory: the contiguous engine `--slots` rows of prompt + max tokens; the paged engine a
pool of the same bytes in blocks of `--page` tokens and `--paged-slots` x the slots, so blocks,
not slots, bound what it runs. Reports sequences in flight per decode step (mean = tokens /
steps; max = the most live in one hand-back), new tokens per second (best of --repeats warm runs
after a cold one) and the paged engine's preemptions. Then the rollout benchmark's W1, W2 and W5
(benchmarks/rollout.py: every sequence reserved whole fits) on each cache at the same slots, in
interleaved rounds: what paging costs where max-length reservation wastes nothing.

  python benchmarks/paged_kv.py            # ~6 min on 2 cores; benchmarks/out/paged_kv.json + README table
  python benchmarks/paged_kv.py --same-slots-only   # the W1/W2/W5 part alone, printed
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
CLUSTER = os.path.join(os.path.dirname(HERE), "meshes", "cluster-v5p-h100.yaml")


def cluster_workload():
  """The AReaL-Hex-shaped workload of the cluster file the planner examples use."""
  import yaml

  from jaxrl_hex.planner.cost_model import Workload
  with open(CLUSTER) as f:
    return Workload.from_dict(yaml.safe_load(f)["workload"])


def workload(prompts: int, group: int, mean: int, seed: int = 0) -> dict:
  """`prompts` groups of `group` samples, lengths shaped as cluster_workload() at `mean` tokens."""
  shape, rng = cluster_workload(), np.random.default_rng(seed)
  sigma, longest = shape.output_sigma, round(mean * shape.output_max / shape.output_mean)
  prompt_len = max(2, round(mean * shape.prompt_len / shape.output_mean))
  # a group's samples share a Request and so its budget
  budgets = np.clip(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, prompts), 1, longest).astype(int)
  ids = np.concatenate(
      [np.full((prompts, 1), bench.BOS),
       rng.integers(3, bench.MODEL["vocab_size"], (prompts, prompt_len - 1))], 1)
  return dict(prompts=ids.astype(np.int32), group=group, budgets=np.repeat(budgets, group).tolist(), max_new=longest,
              sigma=sigma)


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
      f"(lognormal, sigma {w['sigma']}, clipped at {w['max_new']}: meshes/cluster-v5p-h100.yaml's workload scaled "
      f"down); both engines hold {ring['kv_cache_bytes'] / 2**20:.1f} MiB of KV.", "",
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


def speed(rounds: int, repeats: int, page: int) -> dict:
  """rollout.py's workloads on each cache, both engines in one process, their warm runs alternating
  (contiguous, paged, contiguous, ...), best new tokens/s of rounds x repeats runs each."""
  import jax

  from jaxrl_hex.rollout.engine import Engine, Request
  pool, policy, params = bench._our_policy()
  best = {}
  for name in ("W1", "W2", "W5"):
    w, engines = bench.workload(name), {}
    for p in (0, page):
      engines[p] = Engine(policy, pool, bench.IntTokenizer(), w["max_new"], temperature=1.0, slots=w["slots"],
                          max_prompt_len=w["prompts"].shape[1], eos_ids=(bench.EOS,), steps_per_sync=16, kv_page_size=p)
      engines[p].load_weights(0, params)

    def run(engine, seed, w=w):
      engine.rng = jax.random.key(seed)
      g = w["group"]
      engine.submit([Request(x.tolist(), n=g, max_tokens=w["budgets"][i * g]) for i, x in enumerate(w["prompts"])])
      tokens = 0
      while engine.pending:
        tokens += sum(len(s.tokens) for s in engine.poll())
      return tokens

    for engine in engines.values():
      run(engine, 0)  # compiles
    for k in range(rounds * repeats):
      for p, engine in engines.items():
        t0 = time.perf_counter()
        tokens = run(engine, k + 1)
        best[(name, p)] = max(best.get((name, p), 0.0), tokens / (time.perf_counter() - t0))
  return {name: dict(contiguous=best[(name, 0)], paged=best[(name, page)]) for name in ("W1", "W2", "W5")}


def speed_table(result, page) -> str:
  rows = [
      "", f"Same slots, rollout.py's workloads (`kv_page_size={page}`, blocks = the contiguous cache's memory; both "
      "engines in one process, their warm runs alternating, best of each):", "",
      "| workload | contiguous tok/s | paged tok/s | paged / contiguous |", "|---|---|---|---|"
  ]
  for name, r in result.items():
    rows.append(f"| {name} | {r['contiguous']:.0f} | {r['paged']:.0f} | {r['paged'] / r['contiguous']:.2f}x |")
  return "\n".join(rows)


def r_blocks(r) -> str:
  return f"{r['kv_blocks']} blocks x {r['kv_page_size']} tokens"


def main():
  from readme_section import write_section  # benchmarks/ is on the path when run as a script
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--group", type=int, default=4)
  ap.add_argument("--mean", type=int, default=48, help="mean new tokens (prompt and longest budget scale with it)")
  ap.add_argument("--slots", type=int, default=16, help="the contiguous engine's slots")
  ap.add_argument("--paged-slots", type=int, default=6, help="the paged engine's slots, as a multiple of --slots")
  ap.add_argument("--page", type=int, default=4)
  ap.add_argument("--steps-per-sync", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--rounds", type=int, default=3, help="rounds of the same-slots speed part (x --repeats runs)")
  ap.add_argument("--json", default=os.path.join(HERE, "out", "paged_kv.json"))
  ap.add_argument("--same-slots-only", action="store_true",
                  help="only the same-slots speed part, printed (no JSON, no README table)")
  args = ap.parse_args()
  if args.same_slots_only:
    print(speed_table(speed(args.rounds, args.repeats, 16), 16))
    return
  w = workload(args.prompts, args.group, args.mean)
  length = w["prompts"].shape[1] + w["max_new"]
  ring = run_engine(w, args.slots, 0, 0, args.steps_per_sync, args.repeats)
  blocks = args.slots * -(-length // args.page)  # the contiguous cache's memory, in blocks
  paged = run_engine(w, args.paged_slots * args.slots, args.page, blocks, args.steps_per_sync, args.repeats)
  assert ring["kv_cache_bytes"] == paged["kv_cache_bytes"], (ring, paged)
  same_slots = speed(args.rounds, args.repeats, 16)
  text = table(w, ring, paged) + "\n" + speed_table(same_slots, 16)
  print(text)
  write_section("paged-kv", text, "Paged KV cache (benchmarks/paged_kv.py)")
  os.makedirs(os.path.dirname(args.json), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(
        dict(workload={
            k: v for k, v in w.items() if k != "prompts"
        }, contiguous=ring, paged=paged, same_slots=same_slots), f, indent=2)


if __name__ == "__main__":
  main()
