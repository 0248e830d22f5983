"""A batch's long tail on a warmed-up ring engine (an RL step's rollout): 32 prompts on 32 slots,
4 of them sampling 256 new tokens and 28 sampling 16, so after the first call 4 slots decode on
alone until the ring's end. Two engines of benchmarks/rollout.py's model, both warmed up (as a
training run's are), their runs alternating, best of each kept:

  all slots   a call narrower than the ring runs on every slot (the rule before issue 20's change)
  ours        Engine._call: the live slots only, at the ring's whole width (a program warmup
              compiled), where that reads fewer cache columns than all slots at the call's span

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


def workload() -> dict:
  rng = np.random.default_rng(0)
  n = 32
  prompts = np.concatenate([np.full((n, 1), rollout.BOS), rng.integers(3, rollout.MODEL["vocab_size"], (n, 31))], 1)
  budgets = rng.permutation([256] * 4 + [16] * 28).tolist()
  return dict(prompts=prompts.astype(np.int32), group=1, budgets=budgets, slots=n, max_new=max(budgets))


def measure(rounds: int) -> dict:
  w = workload()
  pool, policy, params = rollout._our_policy()
  engines, warmup_s = {}, {}
  for name in ("all slots", "ours"):
    engine = rollout.our_engine(w, pool, policy, params)
    if name == "all slots":
      engine._call = lambda span, e=engine: (span, e._rows() if e._on_rows(span) else None)
    warmup_s[name] = engine.warmup([w["prompts"].shape[1]], w["group"])
    engines[name] = engine
  times, tokens = {name: [] for name in engines}, set()
  for i in range(rounds):
    for name, engine in engines.items():
      t0 = time.perf_counter()
      tokens.add(rollout.run_workload(engine, w, i % 2))  # the same two samplings for both
      times[name].append(time.perf_counter() - t0)
  assert len(tokens) <= 2, tokens
  best = {name: min(t) for name, t in times.items()}
  return dict(rounds=rounds, new_tokens=sorted(tokens), seconds=best, median_seconds={
      name: float(np.median(t)) for name, t in times.items()
  }, ours_over_all_slots=best["all slots"] / best["ours"], programs={
      name: e.compile_count for name, e in engines.items()
  }, warmup_seconds=warmup_s)


def table(r) -> str:
  lines = ["| rule | run (ms), best | median | programs warmup compiled | warmup (s) |", "|---|---|---|---|---|"]
  lines += [
      f"| {name} | {r['seconds'][name] * 1e3:.0f} | {r['median_seconds'][name] * 1e3:.0f} | {r['programs'][name]} | "
      f"{r['warmup_seconds'][name]:.1f} |" for name in ("all slots", "ours")
  ]
  speed = f"ours / all slots: **{r['ours_over_all_slots']:.2f}x** the speed, {r['rounds']} rounds."
  return "\n".join(lines) + "\n\n" + speed


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--readme", action="store_true", help="write the table into benchmarks/README.md")
  args = ap.parse_args()
  from readme_section import report  # benchmarks/ is on the path when run as a script
  r = measure(args.rounds)
  report(os.path.join(HERE, "out", "batch_tail.json"), r, table(r), args.readme, "batch-tail",
         "A batch's long tail on a warmed-up engine (benchmarks/batch_tail.py)")


if __name__ == "__main__":
  from jaxrl_hex.host_memory import restart_with_huge_pages
  restart_with_huge_pages()  # under JAXRL_HEX_MALLOC=huge, as the jaxrl-hex program does (jaxrl_hex/host_memory.py)
  main()
