"""Weight sync's copies with and without streaming stores: glibc's tunable
glibc.cpu.x86_non_temporal_threshold, which a process reads only when it starts (every jaxrl-hex
process restarts itself with it, host_memory.restart_with_tunables; this script's children do
not). Processes started alternately under each setting, each measuring 128 MB copied whole and in
1 MiB pieces (one thread) and device_put sync's round back to back (benchmarks/cluster.py's model
and layouts: publish, settle beside it, receive) against one memcpy, the best of `--rounds`
rounds; the table keeps each setting's best process.

  python benchmarks/sync_copies.py [--processes 3] [--rounds 16] [--readme]
      ->  benchmarks/out/sync_copies.json
"""
import argparse
import functools
import json
import os
import subprocess
import sys
import threading

from row_copies import best_seconds  # benchmarks/ is on the path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {
    "glibc's own (stores past the cache above 3/4 of the L3 share)": "",
    "streaming from 256 KiB": "glibc.cpu.x86_non_temporal_threshold=0x40000"
}


def _round_trip(sync, params, versions):
  """One version published, settled beside it (the trainer's side, as before its next step) and received."""
  import jax
  handle = sync.publish(next(versions), params)
  settle = threading.Thread(target=sync.settle)
  settle.start()
  jax.block_until_ready(sync.receive(handle)[1])
  settle.join()


def measure(rounds: int) -> dict:
  """In this process, as it started: copy rates and device_put's round, per params layout."""
  import numpy as np
  src = np.ones(128 << 18, np.float32)  # 128 MiB
  dst = np.empty_like(src)
  piece = (1 << 20) // 4

  def pieces():
    for i in range(0, src.size, piece):
      np.copyto(dst[i:i + piece], src[i:i + piece])

  out = dict(whole_gb_s=src.nbytes / best_seconds(lambda: np.copyto(dst, src), rounds) / 1e9,
             pieces_gb_s=src.nbytes / best_seconds(pieces, rounds) / 1e9)
  from jaxrl_hex import meshes
  meshes.prepare_cpu_devices(8)
  import cluster

  from jaxrl_hex.models.config import model_config
  from jaxrl_hex.models.policy import Policy, param_bytes
  from jaxrl_hex.sync.device_put import DevicePutSync
  pools = meshes.build_pools(meshes.load_mesh_file(os.path.join(os.path.dirname(HERE), "meshes", "cpu-8.yaml")))
  for layout, extra in cluster.PARAM_LAYOUTS:
    policy = Policy.build(model_config(**cluster.MODEL, **extra))
    params = policy.init(0, pools["train"].shardings_for(policy.logical_axes(), policy.shapes()))
    sync = DevicePutSync(pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes()))
    round_trip = functools.partial(_round_trip, sync, params, iter(range(10**6)))
    memcpy = param_bytes(params) / (out["whole_gb_s"] * 1e9)  # at the best whole copy's rate above
    out[layout] = best_seconds(round_trip, rounds) / memcpy
    sync.close()
  return out


def table(best: dict) -> str:
  layouts = [k for k in next(iter(best.values())) if not k.endswith("gb_s")]
  lines = [
      "| memcpy stores | 128 MB whole, GB/s | in 1 MiB pieces, GB/s | " +
      " | ".join(f"device_put sync, {k}: x one memcpy" for k in layouts) + " |", "|---|---|---|" + "---|" * len(layouts)
  ]
  for name, r in best.items():
    lines.append(f"| {name} | {r['whole_gb_s']:.1f} | {r['pieces_gb_s']:.1f} | " +
                 " | ".join(f"**{r[k]:.2f}**" for k in layouts) + " |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--processes", type=int, default=3, help="processes under each setting, alternating")
  ap.add_argument("--rounds", type=int, default=16)
  ap.add_argument("--readme", action="store_true", help="write the table into benchmarks/README.md")
  ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # a child: one JSON line
  args = ap.parse_args()
  if args.measure:
    print(json.dumps(measure(args.rounds)))
    return
  runs = {name: [] for name in SETTINGS}
  for _ in range(args.processes):
    for name, tunables in SETTINGS.items():
      env = dict(os.environ, GLIBC_TUNABLES=tunables, PYTHONPATH=os.path.dirname(HERE))
      out = subprocess.run([sys.executable, __file__, "--measure", "--rounds",
                            str(args.rounds)], env=env, capture_output=True, text=True, check=True)
      runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
      print(name, runs[name][-1], flush=True)
  pick = lambda rs, k: (max if k.endswith("gb_s") else min)(r[k] for r in rs)
  best = {name: {k: pick(rs, k) for k in rs[0]} for name, rs in runs.items()}
  from readme_section import report
  report(os.path.join(HERE, "out", "sync_copies.json"), dict(runs=runs, best=best), table(best), args.readme,
         "sync-copies", "Weight sync's copies and glibc's streaming stores (benchmarks/sync_copies.py)")


if __name__ == "__main__":
  main()  # each child runs under the setting it is given
