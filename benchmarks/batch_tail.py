"""Decode calls with few live slots on a ring engine, three rules for which slots and columns a
call runs on, on benchmarks/rollout.py's model (one engine per rule, each run once untimed to
compile what it runs, then their runs alternating, best of each kept):

  all slots       a call narrower than the ring runs on every slot (a warmed-up engine's rule
                  before issue 20's change); one spanning the whole ring on the live slots
  span x bucket   every call on its live slots at its span (an unwarmed engine's rule before
                  it): a program per pair of span and row bucket
  ours            Engine._call: the live slots at the ring's whole width where that reads fewer
                  cache columns than all slots at the call's span, else all slots

Two workloads: "long tail", an RL step's batch of 32 prompts on 32 slots, 4 of them sampling
256 new tokens and 28 sampling 16, so 4 slots decode on alone before the ring wraps; "few
prompts", 4 of W1's prompts (64 new tokens) on its 32 slots, as generate or an eval runs.

  taskset -c 1 python benchmarks/batch_tail.py [--rounds 5] [--readme]
      ->  benchmarks/out/batch_tail.json
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import rollout  # noqa: E402

RULES = {
    "all slots": lambda e: lambda span: (span, e._rows() if span == e._width else None),
    "span x bucket": lambda e: lambda span: (span, e._rows()),
    "ours": lambda e: e._call,
}


def workloads() -> dict:
  rng = np.random.default_rng(0)
  n = 32
  prompts = np.concatenate([np.full((n, 1), rollout.BOS), rng.integers(3, rollout.MODEL["vocab_size"], (n, 31))], 1)
  budgets = rng.permutation([256] * 4 + [16] * 28).tolist()
  tail = dict(prompts=prompts.astype(np.int32), group=1, budgets=budgets, slots=n, max_new=max(budgets))
  w1 = rollout.workload("W1")
  return {"long tail": tail, "few prompts": dict(w1, prompts=w1["prompts"][:4], budgets=w1["budgets"][:4])}


def measure(name: str, w: dict, rounds: int) -> list:
  pool, policy, params = rollout._our_policy()
  engines, cold = {}, {}
  for rule, pick in RULES.items():
    engine = rollout.our_engine(w, pool, policy, params)
    engine._call = pick(engine)
    t0 = time.perf_counter()
    rollout.run_workload(engine, w, 0)  # compiles what it runs
    cold[rule], engines[rule] = time.perf_counter() - t0, engine
  times, tokens = {rule: [] for rule in engines}, set()
  for i in range(rounds):
    for rule, engine in engines.items():
      t0 = time.perf_counter()
      tokens.add(rollout.run_workload(engine, w, i % 2))  # the same two samplings for every rule
      times[rule].append(time.perf_counter() - t0)
  assert len(tokens) <= 2, tokens
  return [
      dict(workload=name, rule=rule, seconds=min(t), median_seconds=float(np.median(t)),
           programs=engines[rule].compile_count, cold_seconds=cold[rule], rounds=rounds,
           ours_speedup=min(t) / min(times["ours"])) for rule, t in times.items()
  ]


def table(rows) -> str:
  lines = [
      "| workload | rule | run (ms), best | median | its time / ours | programs | first run, compiling (s) |",
      "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    faster = "" if r["rule"] == "ours" else f"**{r['ours_speedup']:.2f}x**"
    lines.append(f"| {r['workload']} | {r['rule']} | {r['seconds'] * 1e3:.0f} | {r['median_seconds'] * 1e3:.0f} | "
                 f"{faster} | {r['programs']} | {r['cold_seconds']:.1f} |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--readme", action="store_true", help="write the table into benchmarks/README.md")
  args = ap.parse_args()
  from readme_section import report  # benchmarks/ is on the path when run as a script
  rows = [row for name, w in workloads().items() for row in measure(name, w, args.rounds)]
  report(os.path.join(HERE, "out", "batch_tail.json"), rows, table(rows), args.readme, "batch-tail",
         "Decode calls with few live slots (benchmarks/batch_tail.py)")


if __name__ == "__main__":
  from jaxrl_hex.host_memory import restart_with_tunables
  restart_with_tunables()  # with glibc's tunables, as the jaxrl-hex program starts (jaxrl_hex/host_memory.py)
  main()
