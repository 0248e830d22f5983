"""What a rollout's parts cost: W1 (or --workload's, benchmarks/rollout.py) on two engines in one
process, the second compiled with one part of its programs changed, their runs alternating (best of
each kept):

  identical              nothing changed: the noise floor between two engines
  attention 8 columns    every decode call attends to 8 cache columns instead of its span
  attention full width   every call attends to the whole ring (no narrowed copy of the cache)
  argmax                 sampling replaced by an argmax (no draw, no logprob)
  no RoPE                q and k not rotated
  no RMSNorm             every norm the identity
  no softmax             attention's probabilities replaced by the scaled scores

Each change is made where the programs are traced, so the two engines differ in that part only;
the changed one's outputs are wrong (except identical's), which only its time is read for.

  taskset -c 1 python benchmarks/decode_parts.py [--rounds 6] [--workload W1|W2|W5] [--readme]
      ->  benchmarks/out/decode_parts.json (decode_parts_W5.json, ...; --readme: W1 only)
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import rollout  # noqa: E402

from jaxrl_hex.models import decoder  # noqa: E402
from jaxrl_hex.rollout import engine as engine_module, slots  # noqa: E402

CHANGED = {"on": False}  # read where the programs are traced: the second engine compiles with it on


def _switch(owner, name, changed):
  """owner.name traced as `changed` while CHANGED is on, as itself otherwise."""
  plain = getattr(owner, name)

  def either(*args, **kwargs):
    return (changed if CHANGED["on"] else plain)(*args, **kwargs)

  setattr(owner, name, either)


PARTS = {
    "identical": lambda: None,
    "attention 8 columns": lambda: _switch(engine_module.Engine, "_span", lambda self, end: 8),
    "attention full width": lambda: _switch(engine_module.Engine, "_span", lambda self, end: self._width),
    "argmax": lambda: _switch(slots, "sample", lambda logits, keys, **_:
                              (jnp.argmax(logits, -1).astype(jnp.int32), logits[:, 0])),
    "no RoPE": lambda: _switch(decoder, "rope", lambda x, table: x),
    "no RMSNorm": lambda: _switch(decoder.RMSNorm, "__call__", lambda self, x: x),
    "no softmax": lambda: _switch(jax.nn, "softmax", lambda x, axis=-1: x * 1e-3),
}


def measure(part: str, rounds: int, workload: str = "W1") -> dict:
  """A fresh pair of engines for `part` (its change installed first) -> best and median seconds of each."""
  PARTS[part]()
  w = rollout.workload(workload)
  pool, policy, params = rollout._our_policy()

  engine = lambda: rollout.our_engine(w, pool, policy, params)

  def run(e, seed):
    t0 = time.perf_counter()
    rollout.run_workload(e, w, seed)
    return time.perf_counter() - t0

  plain = engine()
  run(plain, 0)  # compiles
  CHANGED["on"] = True
  changed = engine()
  run(changed, 0)  # compiles with the change
  times = {"plain": [], "changed": []}
  for i in range(rounds):
    CHANGED["on"] = False
    times["plain"].append(run(plain, i + 1))
    CHANGED["on"] = True
    times["changed"].append(run(changed, i + 1))
  CHANGED["on"] = False
  best = {k: min(v) for k, v in times.items()}
  return dict(part=part, workload=workload, plain_s=best["plain"], changed_s=best["changed"],
              ratio=best["changed"] / best["plain"],
              median_ratio=float(np.median(times["changed"]) / np.median(times["plain"])), rounds=rounds)


def table(rows, workload="W1") -> str:
  lines = [
      f"| changed part | {workload} run, plain (ms) | {workload} run, changed (ms) | changed / plain | "
      "medians' ratio |",
      "|---|---|---|---|---|",
  ]
  lines += [
      f"| {r['part']} | {r['plain_s'] * 1e3:.1f} | {r['changed_s'] * 1e3:.1f} | **{r['ratio']:.3f}** | "
      f"{r['median_ratio']:.3f} |" for r in rows
  ]
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument("--part", choices=tuple(PARTS), help="this one only, in this process: one JSON line")
  ap.add_argument("--workload", default="W1", choices=("W1", "W2", "W5"))
  ap.add_argument("--readme", action="store_true", help="write the table into benchmarks/README.md")
  args = ap.parse_args()
  if args.readme and args.workload != "W1":
    ap.error("--readme: benchmarks/README.md's table is W1's")
  if args.part:
    print(json.dumps(measure(args.part, args.rounds, args.workload)))
    return
  rows = []
  for part in PARTS:  # each in its own process: a change, once installed, stays
    out = subprocess.run([
        sys.executable,
        os.path.abspath(__file__), "--rounds",
        str(args.rounds), "--part", part, "--workload", args.workload
    ], capture_output=True, text=True, check=True)
    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps(rows[-1]), flush=True)
  from readme_section import report  # benchmarks/ is on the path when run as a script
  name = "decode_parts" if args.workload == "W1" else f"decode_parts_{args.workload}"
  report(os.path.join(HERE, "out", f"{name}.json"), rows, table(rows, args.workload), args.readme, "decode-parts",
         "What a rollout's parts cost (benchmarks/decode_parts.py)")


if __name__ == "__main__":
  from jaxrl_hex.host_memory import restart_with_tunables
  restart_with_tunables()  # with glibc's tunables, as the jaxrl-hex program starts (jaxrl_hex/host_memory.py)
  main()
