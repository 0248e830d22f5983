"""W3's train step (benchmarks/train_vs_tunix.py, no shared prompts) run back to back under each
JAXRL_HEX_MALLOC mode (jaxrl_hex/host_memory.py: system, huge, keep), each in its own process:
per step its seconds, minor page faults and the process's resident memory.

  python benchmarks/host_memory.py [--steps 16] [--layout 1+1|2x2 | --readme]
  ->  benchmarks/out/host_memory_LAYOUT.json
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

STEPS = """
import json, resource, sys
from jaxrl_hex.host_memory import restart_with_huge_pages
restart_with_huge_pages()  # mode huge: as the jaxrl-hex program starts
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


def run(malloc: str, layout: str, steps: int) -> list:
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}  # huge adds it back itself
  env["JAXRL_HEX_MALLOC"] = malloc
  code = STEPS.format(here=HERE, layout=layout, steps=steps)
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


MODES = ("system", "huge", "keep")
LAYOUT_NAMES = {"1+1": "one device", "2x2": "2 x 2 (fsdp 2 x tensor 2)"}


def measure(layout: str, steps: int) -> dict:
  results = {}
  for malloc in MODES:
    rows = run(malloc, layout, steps)
    later = sorted(r["step_s"] for r in rows[1:])
    results[malloc] = dict(steps=rows, median_step_s=later[len(later) // 2],
                           median_faults=sorted(r["faults"] for r in rows[1:])[len(later) // 2],
                           rss_gb_first=rows[0]["rss_gb"], rss_gb_last=rows[-1]["rss_gb"])
    print(
        f"{layout} {malloc}: median step {results[malloc]['median_step_s']:.2f} s, median faults "
        f"{results[malloc]['median_faults']}, resident {rows[0]['rss_gb']:.1f} -> {rows[-1]['rss_gb']:.1f} GB; "
        "steps " + " ".join(f"{r['step_s']:.2f}" for r in rows), flush=True)
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  with open(os.path.join(HERE, "out", f"host_memory_{layout}.json"), "w") as f:
    json.dump(results, f, indent=1)
  return results


def table(by_layout: dict) -> str:
  rows = [
      "| W3 layout | JAXRL_HEX_MALLOC | median step s | / system | page faults a step | "
      "resident GB, first -> last step |", "|---|---|---|---|---|---|"
  ]
  for layout, results in by_layout.items():
    system = results["system"]["median_step_s"]
    for malloc in MODES:
      r = results[malloc]
      rows.append(f"| {LAYOUT_NAMES[layout]} | {malloc}{' (default)' if malloc == 'huge' else ''} | "
                  f"{r['median_step_s']:.2f} | {r['median_step_s'] / system:.2f} | {r['median_faults']:,} | "
                  f"{r['rss_gb_first']:.1f} -> {r['rss_gb_last']:.1f} |")
  return "\n".join(rows)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--layout", default="1+1", choices=tuple(LAYOUT_NAMES))
  ap.add_argument("--readme", action="store_true", help="both layouts; rewrite the table in benchmarks/README.md")
  args = ap.parse_args()
  by_layout = {layout: measure(layout, args.steps) for layout in (LAYOUT_NAMES if args.readme else [args.layout])}
  if args.readme:
    from readme_section import write_section  # benchmarks/ is on the path when run as a script
    write_section("host-memory", table(by_layout), "Host memory for XLA:CPU (benchmarks/host_memory.py)")


if __name__ == "__main__":
  main()
