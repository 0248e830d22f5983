"""How long a run takes to start, and what the persistent compilation cache saves of it.

`jaxrl-hex train` (3 RL steps from a warm start, the default recipe's small settings) in a fresh
process, on the local backend (both pools in one runtime) and on the Ray backend
(meshes/cpu-ray.yaml: a two-process train pool, one rollout replica), under two cache settings,
each with a cache directory of its own: JAX's default, which keeps only programs compiling for over
a second, and the runtime's (jaxrl_hex.runtime.enable_compile_cache), which keeps every program.
One run per setting and backend fills its cache, then `--runs` rounds alternate the settings; each
keeps its best:

  to first eval   process start -> the first evaluation's line: the driver, both pools started,
                  the weight-sync probe, the evaluation
  whole run       process start -> exit (3 steps, the closing evaluation, shutdown)

On the Ray backend spans.jsonl has each pool's start (the train pool's processes joining their
runtime and restoring the warm start; the rollout replica's from the driver asking for it: its
process's launch, runtime, engine and compiles): the pools start side by side, and "overlap" is
the seconds both were starting at once.

python benchmarks/startup.py [--runs 2] [--readme]   # ~4 min quiet -> benchmarks/out/startup.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from readme_section import write_section  # noqa: E402

SMALL = ["--config.rollout.prompts_per_step=8", "--config.rollout.group_size=4", "--config.train.eval_size=64"]
BACKENDS = {
    "local": [],
    "ray": ["--config.mesh_file=meshes/cpu-ray.yaml", "--config.cluster.backend=ray", "--config.sync.method=direct"],
}
SETTINGS = {"JAX default (compiles over 1 s kept)": "1", "every program kept (ours)": None}


def timed_run(args, env) -> dict:
  """A jaxrl-hex command in a fresh process -> seconds to its first evaluation line and to its exit."""
  start = time.perf_counter()
  proc = subprocess.Popen([sys.executable, "-m", "jaxrl_hex.cli", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  first_eval, tail = None, []
  for line in proc.stdout:
    if first_eval is None and line.startswith("train 0/"):
      first_eval = time.perf_counter() - start
    tail = (tail + [line])[-20:]
  if proc.wait():
    raise RuntimeError(f"{args[0]} failed:\n{''.join(tail)}")
  return {"to_first_eval_s": first_eval, "whole_run_s": time.perf_counter() - start}


def pool_starts(workdir) -> dict:
  """The Ray run's start spans -> each pool's start seconds and how long they overlapped."""
  spans = [json.loads(line) for line in open(os.path.join(workdir, "spans.jsonl"))]
  starts = [s for s in spans if s["kind"] == "start"]
  (train,) = [s for s in starts if s["pool"] == "train"]
  rollout = [s for s in starts if s["pool"] == "rollout"]
  overlap = min(s["end"] for s in starts) - max(s["start"] for s in starts)
  return {
      "train_start_s": train["end"] - train["start"],
      "replica_start_s": [s["end"] - s["start"] for s in rollout],
      "overlap_s": max(0.0, overlap)
  }


def measure(tmp, runs):
  """Both backends under both cache settings in `tmp` -> (best figures per (backend, setting), the
  Ray runs' pool starts)."""
  base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE") and k != "JAXRL_HEX_QUIET"}
  warm = os.path.join(tmp, "warm")
  subprocess.run([sys.executable, "-m", "jaxrl_hex.cli", "sft", f"--workdir={warm}", "--config.sft.max_steps=40"],
                 cwd=ROOT, env=dict(base, JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, "sft-cache")), check=True,
                 capture_output=True)
  best, starts = {}, {}
  for round_ in range(runs + 1):  # round 0 fills each setting's cache
    for backend, extra in BACKENDS.items():
      for setting, threshold in SETTINGS.items():
        env = dict(base, JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, f"cache-{threshold}"))
        if threshold is not None:
          env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = threshold
        workdir = os.path.join(tmp, f"run-{round_}-{backend}-{threshold}")
        run = timed_run([
            "train", f"--workdir={workdir}", f"--config.init_from={warm}", "--config.train.steps=3",
            "--config.train.eval_every=100", *SMALL, *extra
        ], env)
        print(round_, backend, setting, {k: round(v, 2) for k, v in run.items()}, flush=True)
        if round_:
          key = (backend, setting)
          best[key] = {k: min(v, best.get(key, run)[k]) for k, v in run.items()}
          if backend == "ray" and threshold is None:
            starts[round_] = pool_starts(workdir)
  return best, starts


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", type=int, default=2, help="measured rounds after the one filling each cache")
  ap.add_argument("--readme", action="store_true", help="rewrite the table in benchmarks/README.md")
  ap.add_argument("--json", default=os.path.join(HERE, "out", "startup.json"))
  args = ap.parse_args()
  with tempfile.TemporaryDirectory(prefix="jaxrl-hex-startup-") as tmp:  # runs, caches, the warm start
    best, starts = measure(tmp, args.runs)
  rows = [dict(backend=b, cache=s, **v) for (b, s), v in best.items()]
  out = {"runs": args.runs, "rows": rows, "ray_pool_starts": list(starts.values())}
  os.makedirs(os.path.dirname(args.json), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=2)
  lines = [
      "| backend | persistent cache | to first eval, s | whole run, s | first eval: default / ours |",
      "|---|---|---|---|---|"
  ]
  for backend in BACKENDS:
    default, ours = (best[backend, s] for s in SETTINGS)
    for setting in SETTINGS:
      r = best[backend, setting]
      ratio = "" if r is default else f"**{default['to_first_eval_s'] / ours['to_first_eval_s']:.2f}x**"
      lines.append(f"| {backend} | {setting} | {r['to_first_eval_s']:.1f} | {r['whole_run_s']:.1f} | {ratio} |")
  s = max(starts.values(), key=lambda x: x["overlap_s"])
  lines.append("")
  lines.append(f"Ray pools' start (spans.jsonl, ours): train pool {s['train_start_s']:.1f} s, rollout replica "
               f"{', '.join(f'{x:.1f}' for x in s['replica_start_s'])} s, both starting at once for "
               f"{s['overlap_s']:.1f} s.")
  text = "\n".join(lines)
  print(text)
  if args.readme:
    write_section("startup", text, "Run start-up and the compilation cache (benchmarks/startup.py)")


if __name__ == "__main__":
  main()
