"""W3's train step (benchmarks/train_vs_tunix.py, no shared prompts) run back to back with malloc
as it is and under JAXRL_HEX_MALLOC=keep (jaxrl_hex/host_memory.py), each in its own process:
per step its seconds, minor page faults and the process's resident memory.

  python benchmarks/host_memory.py [--steps 16] [--layout 1+1|2x2]  ->  benchmarks/out/host_memory_LAYOUT.json
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

STEPS = """
import json, resource, sys
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
  env = dict(os.environ, JAXRL_HEX_MALLOC=malloc)
  code = STEPS.format(here=HERE, layout=layout, steps=steps)
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--layout", default="1+1", choices=("1+1", "2x2"))
  args = ap.parse_args()
  results = {}
  for malloc in ("system", "keep"):
    rows = run(malloc, args.layout, args.steps)
    later = sorted(r["step_s"] for r in rows[1:])
    results[malloc] = dict(steps=rows, median_step_s=later[len(later) // 2],
                           median_faults=sorted(r["faults"] for r in rows[1:])[len(later) // 2],
                           rss_gb_first=rows[0]["rss_gb"], rss_gb_last=rows[-1]["rss_gb"])
    print(f"{args.layout} {malloc}: median step {results[malloc]['median_step_s']:.2f} s, median faults "
          f"{results[malloc]['median_faults']}, resident {rows[0]['rss_gb']:.1f} -> {rows[-1]['rss_gb']:.1f} GB; "
          "steps " + " ".join(f"{r['step_s']:.2f}" for r in rows))
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  with open(os.path.join(HERE, "out", f"host_memory_{args.layout}.json"), "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
