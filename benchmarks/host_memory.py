"""The JAXRL_HEX_MALLOC modes (jaxrl_hex/host_memory.py: system, huge, keep), each in its own process:

  w3      W3's train step (benchmarks/train_vs_tunix.py, no shared prompts) back to back: per step
          its seconds, minor page faults and the process's resident memory (every mode).
  w4      the whole RL step (train_vs_tunix.ours_w4, synchronous and async, 2 x 2 and 1+1):
          seconds a step under system and huge, in alternating pairs of processes.
  faults  the kernel's rate of faulting fresh anonymous memory in (GB/s), 4 KiB pages against
          2 MiB huge pages (madvise), the same 256 MB mapped afresh each time, reused at once and
          after 3 s idle: long enough for a VM that reports free pages to its host (Linux's
          page_reporting waits 2 s) to have given them back.

  python benchmarks/host_memory.py [--part w3|w4|faults|all] [--steps N] [--pairs 3] [--layout 1+1|2x2] [--readme]
  ->  benchmarks/out/host_memory_LAYOUT.json, host_memory_w4.json, host_memory_faults.json
--readme rewrites the tables of the parts run in benchmarks/README.md (w3 then runs both layouts).
"""
import argparse
import json
import mmap
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

STEPS = """
import json, resource, sys
from jaxrl_hex.host_memory import restart_with_tunables
restart_with_tunables()  # as the jaxrl-hex program starts
sys.path.insert(0, {here!r})
import train_vs_tunix as B  # prepare_cpu_devices: host_memory as the CLI sets it up
step, _ = B.ours_w3(64, 32, 64, False, {layout!r})
rows = []
for _ in range({steps}):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  seconds = step()
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
  rss = int(open("/proc/self/statm").read().split()[1]) * 4096
  rows.append(dict(step_s=seconds, faults=faults, rss_gb=rss / 1e9))
print(json.dumps(rows))
"""

W4 = """
import json, sys
from jaxrl_hex.host_memory import restart_with_tunables
restart_with_tunables()
sys.path.insert(0, {here!r})
from train_vs_tunix import W4_WORKLOAD, ours_w4, w4_task  # the loop loads its task as __main__:w4_task
print(json.dumps(ours_w4(**W4_WORKLOAD, steps={steps}, eta={eta}, layout={layout!r})))
"""


def run(malloc: str, code: str):
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}  # huge adds it back itself
  env["JAXRL_HEX_MALLOC"] = malloc
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


MODES = ("system", "huge", "keep")
LAYOUT_NAMES = {"1+1": "one device", "2x2": "2 x 2 (fsdp 2 x tensor 2)"}


def measure(layout: str, steps: int) -> dict:
  results = {}
  for malloc in MODES:
    rows = run(malloc, STEPS.format(here=HERE, layout=layout, steps=steps))
    later = sorted(r["step_s"] for r in rows[1:])
    results[malloc] = dict(steps=rows, median_step_s=later[len(later) // 2],
                           median_faults=sorted(r["faults"] for r in rows[1:])[len(later) // 2],
                           rss_gb_first=rows[0]["rss_gb"], rss_gb_last=rows[-1]["rss_gb"])
    print(
        f"{layout} {malloc}: median step {results[malloc]['median_step_s']:.2f} s, median faults "
        f"{results[malloc]['median_faults']}, resident {rows[0]['rss_gb']:.1f} -> {rows[-1]['rss_gb']:.1f} GB; "
        "steps " + " ".join(f"{r['step_s']:.2f}" for r in rows), flush=True)
  save(layout, results)
  return results


def save(name: str, results):
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  with open(os.path.join(HERE, "out", f"host_memory_{name}.json"), "w") as f:
    json.dump(results, f, indent=1)


def measure_w4(pairs: int, steps: int) -> dict:
  """{run: {mode: [seconds a step, one per pair]}}, the two modes' processes alternating."""
  results = {}
  for layout in ("2x2", "1+1"):
    for eta in (0, 1):
      key = f"{LAYOUT_NAMES[layout]}, {'async (eta 1)' if eta else 'synchronous'}"
      results[key] = {malloc: [] for malloc in ("system", "huge")}
      for _ in range(pairs):
        for malloc in ("system", "huge"):
          code = W4.format(here=HERE, steps=steps, eta=eta, layout=layout)
          results[key][malloc].append(run(malloc, code)["step_s"])
      print(f"W4 {key}: " + "; ".join(f"{m} " + " ".join(f"{s:.2f}" for s in v) for m, v in results[key].items()),
            flush=True)
  save("w4", results)
  return results


def fault_in_rate(huge: bool, idle_s: float, size=256 << 20, repeats=6) -> float:
  """GB/s at which the kernel faults a fresh mapping in (one write a 4 KiB page), median of repeats
  after one warm-up, each mapping unmapped and then left idle_s seconds before the next."""
  rates = []
  for _ in range(repeats + 1):
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
      region.madvise(mmap.MADV_HUGEPAGE)
    pages = np.frombuffer(region, np.uint8)
    start = time.perf_counter()
    pages[::4096] = 1
    rates.append(size / 1e9 / (time.perf_counter() - start))
    del pages
    region.close()
    time.sleep(idle_s)
  return float(np.median(rates[1:]))


def measure_faults() -> dict:
  results = {
      f"{'2 MiB' if huge else '4 KiB'} pages, {when}": fault_in_rate(huge, idle_s)
      for when, idle_s in (("reused at once", 0.0), ("after 3 s idle", 3.0)) for huge in (False, True)
  }
  print("fault-in GB/s: " + "; ".join(f"{k} {v:.2f}" for k, v in results.items()), flush=True)
  save("faults", results)
  return results


def w4_table(results: dict) -> str:
  rows = [
      "| W4 run | system s/step | huge s/step | huge / system, fastest of each | median of each |",
      "|---|---|---|---|---|"
  ]
  for key, r in results.items():
    fastest, median = ({m: f(v) for m, v in r.items()} for f in (min, lambda v: sorted(v)[len(v) // 2]))
    rows.append(f"| {key} | {' / '.join(f'{s:.2f}' for s in r['system'])} | "
                f"{' / '.join(f'{s:.2f}' for s in r['huge'])} | {fastest['huge'] / fastest['system']:.2f} | "
                f"{median['huge'] / median['system']:.2f} |")
  return "\n".join(rows)


def faults_table(results: dict) -> str:
  return "\n".join(["| fresh anonymous memory | faulted in, GB/s |", "|---|---|"] +
                   [f"| {key} | {rate:.2f} |" for key, rate in results.items()])


def table(by_layout: dict) -> str:
  rows = [
      "| W3 layout | JAXRL_HEX_MALLOC | median step s | / system | page faults a step | "
      "resident GB, first -> last step |", "|---|---|---|---|---|---|"
  ]
  for layout, results in by_layout.items():
    system = results["system"]["median_step_s"]
    for malloc in MODES:
      r = results[malloc]
      rows.append(f"| {LAYOUT_NAMES[layout]} | {malloc}{' (default)' if malloc == 'system' else ''} | "
                  f"{r['median_step_s']:.2f} | {r['median_step_s'] / system:.2f} | {r['median_faults']:,} | "
                  f"{r['rss_gb_first']:.1f} -> {r['rss_gb_last']:.1f} |")
  return "\n".join(rows)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--part", choices=("w3", "w4", "faults", "all"), default="w3")
  ap.add_argument("--steps", type=int, help="w3: steps a mode (default 16); w4: steady steps a run (default 3)")
  ap.add_argument("--pairs", type=int, default=3, help="w4: alternating pairs of processes a run")
  ap.add_argument("--layout", default="1+1", choices=tuple(LAYOUT_NAMES), help="w3")
  ap.add_argument("--readme", action="store_true",
                  help="rewrite the parts' tables in benchmarks/README.md (w3: both layouts)")
  args = ap.parse_args()
  parts = ("faults", "w4", "w3") if args.part == "all" else (args.part,)
  tables = {}
  if "faults" in parts:
    tables["host-memory-faults"] = faults_table(measure_faults())
  if "w4" in parts:
    tables["host-memory-w4"] = w4_table(measure_w4(args.pairs, args.steps or 3))
  if "w3" in parts:
    layouts = LAYOUT_NAMES if args.readme else [args.layout]
    tables["host-memory"] = table({layout: measure(layout, args.steps or 16) for layout in layouts})
  if args.readme:
    from readme_section import write_section  # benchmarks/ is on the path when run as a script
    for name, text in tables.items():
      write_section(name, text, "Host memory for XLA:CPU (benchmarks/host_memory.py)")


if __name__ == "__main__":
  main()
