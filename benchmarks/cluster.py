"""Issue 6 figures, each a ratio against a baseline measured in the same run:

  sync     seconds and GB/s of each weight-sync method (train layout -> rollout layout) against
           this machine's memcpy rate (device_put, direct) and disk write+read rate (orbax)
  async    seconds per RL step, eta=2 against eta=0 (synchronous), Ray backend, the two pools
           pinned to disjoint CPU cores; the reward curves of both runs side by side. The driver
           (orchestrator, reward scoring) is pinned to the rollout pool's core: the trainer is
           the slower side, and on 2 cores an unpinned driver takes its time from both pools.
           Both runs use the trainer's cheaper options (algo.prox_logp=interpolate,
           algo.share_prompts), so the two sides are closer to balanced.

python benchmarks/cluster.py [--part sync|async|all] [--steps 40] [--json benchmarks/out/cluster.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(vocab_size=512, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, mlp_dim=2048)


def memcpy_gbps(nbytes):
  src = np.ones(nbytes // 4, np.float32)
  dst = np.empty_like(src)
  best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
  return nbytes / best / 1e9


def disk_gbps(nbytes, directory):
  data = np.ones(nbytes, np.uint8)
  path = os.path.join(directory, "disk-probe.bin")

  def write_read():
    with open(path, "wb") as f:
      f.write(data.tobytes())
      f.flush()
      os.fsync(f.fileno())
    with open(path, "rb") as f:
      f.read()

  seconds = min(_timed(write_read) for _ in range(3))
  os.remove(path)
  return nbytes / seconds / 1e9


def _timed(fn):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def bench_sync(repeats=3):
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import ray

  from jaxrl_hex import meshes
  from jaxrl_hex.models.config import model_config
  from jaxrl_hex.models.policy import Policy, param_bytes
  from jaxrl_hex.sync import make_sync
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  pools = meshes.build_pools(meshes.load_mesh_file(os.path.join(ROOT, "meshes", "cpu-8.yaml")))
  policy = Policy.build(model_config(**MODEL))
  train_sh = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
  rollout_sh = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  params = policy.init(0, train_sh)
  nbytes = param_bytes(params)
  rows = []
  with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
    base = {"memcpy": memcpy_gbps(nbytes), "disk": disk_gbps(nbytes, tmp)}
    for method, baseline in (("device_put", "memcpy"), ("direct", "memcpy"), ("orbax", "disk")):
      publisher = make_sync(method, policy.shapes(), rollout_sh if method == "device_put" else None,
                            os.path.join(tmp, "sync"))
      receiver = publisher if method == "device_put" else make_sync(method, policy.shapes(), rollout_sh,
                                                                    os.path.join(tmp, "sync"))
      seconds = []
      for v in range(repeats + 1):  # the first round compiles / warms caches
        start = time.perf_counter()
        handle = publisher.publish(v, params)
        _, got = receiver.receive(handle)
        jax.block_until_ready(got)
        seconds.append(time.perf_counter() - start)
      s = min(seconds[1:])
      gbps = nbytes / s / 1e9
      rows.append({
          "method": method,
          "bytes": nbytes,
          "seconds": s,
          "gb_per_s": gbps,
          "baseline": baseline,
          "baseline_gb_per_s": base[baseline],
          "ratio_to_baseline": gbps / base[baseline]
      })
  ray.shutdown()
  return rows


DRIVER_CORES = {1}  # meshes/cpu-ray-pinned.yaml: rollout on core 1, trainer on core 0


def _train(workdir, steps, eta, init_from):
  cmd = [
      sys.executable, "-m", "jaxrl_hex.cli", "train", f"--workdir={workdir}", f"--config.init_from={init_from}",
      "--config.mesh_file=meshes/cpu-ray-pinned.yaml", "--config.cluster.backend=ray", "--config.sync.method=direct",
      f"--config.train.steps={steps}", f"--config.train.max_staleness={eta}", "--config.algo.prox_logp=interpolate",
      "--config.algo.share_prompts=True", f"--config.train.eval_every={steps}", "--config.train.checkpoint_every=100000"
  ]
  subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, JAXRL_HEX_QUIET="1"), stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL, preexec_fn=lambda: os.sched_setaffinity(0, DRIVER_CORES))
  from jaxrl_hex.metrics import read_jsonl
  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") == "train" and "loss" in r]
  skip = min(5, steps // 4)  # compile and first syncs
  # up to the last step before the closing evaluation (the same for both runs, not part of a step)
  per_step = (rows[-2]["wall_s"] - rows[skip]["wall_s"]) / (len(rows) - 2 - skip)
  return {
      "eta": eta,
      "seconds_per_step": per_step,
      "reward": [r["reward_mean"] for r in rows],
      "eval_accuracy_end": rows[-1].get("eval_accuracy")
  }


def bench_async(steps):
  with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
    warm = os.path.join(tmp, "warm")
    subprocess.run([sys.executable, "-m", "jaxrl_hex.cli", "sft", f"--workdir={warm}"], cwd=ROOT, check=True,
                   env=dict(os.environ, JAXRL_HEX_QUIET="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sync_run = _train(os.path.join(tmp, "eta0"), steps, 0, warm)
    async_run = _train(os.path.join(tmp, "eta2"), steps, 2, warm)
  tail = max(steps // 4, 1)
  return {
      "steps": steps,
      "sync": sync_run,
      "async": async_run,
      "speedup": sync_run["seconds_per_step"] / async_run["seconds_per_step"],
      "reward_tail_mean": {
          "eta0": float(np.mean(sync_run["reward"][-tail:])),
          "eta2": float(np.mean(async_run["reward"][-tail:]))
      }
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--part", default="all", choices=["sync", "async", "all"])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "out", "cluster.json"))
  args = parser.parse_args()
  out = {}
  if args.part in ("sync", "all"):
    out["sync"] = bench_sync()
    for r in out["sync"]:
      print(f"sync {r['method']:>10}: {r['seconds']*1e3:7.1f} ms  {r['gb_per_s']:6.2f} GB/s  "
            f"= {r['ratio_to_baseline']:.2f}x {r['baseline']} ({r['baseline_gb_per_s']:.2f} GB/s)")
  if args.part in ("async", "all"):
    out["async"] = bench_async(args.steps)
    a = out["async"]
    print(f"async: eta=0 {a['sync']['seconds_per_step']:.3f} s/step, eta=2 {a['async']['seconds_per_step']:.3f} "
          f"s/step -> {a['speedup']:.2f}x; reward (last quarter) {a['reward_tail_mean']}")
  os.makedirs(os.path.dirname(args.json), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=2)
  print(json.dumps(out)[:2000])


if __name__ == "__main__":
  main()
