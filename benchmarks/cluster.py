"""Issue 6 and 20 figures, each a ratio against a baseline measured in the same run:

  sync     seconds and GB/s of each weight-sync method (train layout -> rollout layout) against
           this machine's memcpy rate (device_put, direct) and disk write+fsync+read rate (orbax),
           measured in rounds interleaved with the methods, best round of each kept; the same
           model's params per layer (75 leaves) and stacked (model.scan_layers: 12 leaves)
  async    seconds per RL step, eta=2 against eta=0 (synchronous), Ray backend, the two pools
           pinned to disjoint CPU cores; the reward curves of both runs side by side. The driver
           (orchestrator, reward scoring) is pinned to the rollout pool's core: the trainer is
           the slower side, and on 2 cores an unpinned driver takes its time from both pools.
           Both runs use the trainer's cheaper options (algo.prox_logp=interpolate,
           algo.share_prompts), so the two sides are closer to balanced.
  wait     (with sync) the share of its step time the trainer waits on sync: `jaxrl-hex train`
           on the local backend, the default model and the 128 MB one (fresh weights)

python benchmarks/cluster.py [--part sync|async|all] [--steps 40] [--wait-steps 10] [--readme]
                             [--json benchmarks/out/cluster.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(vocab_size=512, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, mlp_dim=2048)
# The same bytes in two trees: a leaf per layer's tensor, or each tensor stacked over the layers
# (model.scan_layers). A sync's cost per leaf (reading its shards, wrapping its regions as arrays,
# a tensorstore array per leaf) is paid 75 or 12 times.
PARAM_LAYOUTS = (("per layer", {}), ("stacked", {"scan_layers": True}))


def memcpy_seconds(nbytes):
  """One copy of nbytes between two warm buffers -> (wall, CPU) seconds: the bound of a copy in memory."""
  src = np.ones(nbytes // 4, np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)  # warm
  return _timed(lambda: np.copyto(dst, src))


def disk_seconds(nbytes, directory):
  """nbytes written, fsynced and read back: the bound of a sync through a file system."""
  data = np.ones(nbytes, np.uint8)
  path = os.path.join(directory, "disk-probe.bin")

  def write_read():
    with open(path, "wb") as f:
      f.write(data.tobytes())
      f.flush()
      os.fsync(f.fileno())
    with open(path, "rb") as f:
      f.read()

  seconds = _timed(write_read)
  os.remove(path)
  return seconds


def _timed(fn):
  """-> (wall seconds, CPU seconds of this process's threads): CPU time is what other processes'
  load on this machine leaves alone."""
  start, cpu = time.perf_counter(), time.process_time()
  fn()
  return time.perf_counter() - start, time.process_time() - cpu


# (method, its baseline, the copies of the model's bytes it makes at most): device_put assembles
# each distinct region of the rollout layout once (replicas alias it on CPU); direct copies into
# the object store, then out of it into the rollout layout the regions not lying whole in it (here
# the leaves split over fsdp on a later axis, 43 of the 128 MB: 1.34 copies), or within one host
# (sync.transport=shared_memory) into the rollout layout's regions in shared memory, used in place;
# orbax writes, fsyncs and reads once.
METHODS = (("device_put", "memcpy", 1), ("direct", "memcpy", 2), ("direct shared memory", "memcpy", 1), ("orbax",
                                                                                                         "disk", 1))


def _sides(method, policy, rollout_sh, rollout_spec, directory):
  """-> (publisher, receiver) of `method` between the benchmark's layouts."""
  from jaxrl_hex.sync import make_sync
  from jaxrl_hex.sync.direct import rollout_layouts
  if method == "device_put":
    publisher = make_sync(method, policy.shapes(), rollout_sh)
    return publisher, publisher
  layouts = rollout_layouts([rollout_spec], policy.logical_axes(), policy.shapes()) if method.endswith("memory") else ()
  kind = method.split()[0]
  return (make_sync(kind, policy.shapes(), None, directory,
                    layouts), make_sync(kind, policy.shapes(), rollout_sh, directory))


def bench_sync(rounds=5):
  """Each round: the memcpy and disk baselines once, then publish + receive of every method once;
  the best round of each kept (wall time; CPU time beside it)."""
  from jaxrl_hex import meshes
  meshes.prepare_cpu_devices(8)
  import jax
  import ray

  from jaxrl_hex.models.config import model_config
  from jaxrl_hex.models.policy import Policy, param_bytes
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  pools = meshes.build_pools(meshes.load_mesh_file(os.path.join(ROOT, "meshes", "cpu-8.yaml")))
  best = {}

  def keep(key, value):
    best[key] = min(best.get(key, (float("inf"),)), value)

  with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
    sides = {}  # (param layout, method) -> (params, publisher, receiver)
    for layout, extra in PARAM_LAYOUTS:
      policy = Policy.build(model_config(**MODEL, **extra))
      rollout_sh = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
      params = policy.init(0, pools["train"].shardings_for(policy.logical_axes(), policy.shapes()))
      for method, _, _ in METHODS:
        directory = os.path.join(tmp, layout.replace(" ", "_"), method.replace(" ", "_"))
        sides[layout, method] = (params, *_sides(method, policy, rollout_sh, pools["rollout"].spec, directory))
    nbytes = param_bytes(params)  # the same in both layouts
    held = sum(s.data.nbytes for x in jax.tree.leaves(jax.device_put(params, rollout_sh)) for s in x.addressable_shards)
    for r in range(rounds + 1):  # round 0 compiles and warms caches
      if r:
        keep("memcpy", memcpy_seconds(nbytes))
        keep("disk", disk_seconds(nbytes, tmp))
      for key, (params, publisher, receiver) in sides.items():
        start, cpu = time.perf_counter(), time.process_time()
        handle = publisher.publish(r, params)
        published = time.perf_counter()
        # the trainer goes on to its next step, which first settles the copies still running
        trainer = threading.Thread(target=publisher.settle)
        trainer.start()
        jax.block_until_ready(receiver.receive(handle)[1])
        trainer.join()
        end = time.perf_counter()
        if r:
          keep(key, (end - start, time.process_time() - cpu, published - start, end - published))
  ray.shutdown()
  for _, publisher, _ in sides.values():
    publisher.close()
  rows = []
  for (layout, method), (params, _, _) in sides.items():
    baseline, copies = next((b, c) for m, b, c in METHODS if m == method)
    seconds, cpu_s, publish_s, receive_s = best[layout, method]
    bound_s, bound_cpu_s = best[baseline]
    rows.append({
        "method": method,
        "params": layout,
        "leaves": len(jax.tree.leaves(params)),
        "bytes": nbytes,
        "rollout_bytes": held,  # what the rollout devices hold: data=2 replicates the model
        "seconds": seconds,
        "publish_s": publish_s,  # what the trainer waits for (device_put's copy runs on beside it)
        "receive_s": receive_s,
        "gb_per_s": nbytes / seconds / 1e9,
        "baseline": baseline,
        "baseline_gb_per_s": nbytes / bound_s / 1e9,
        "ratio_to_baseline": bound_s / seconds,  # = the method's GB/s over the baseline's
        "times_bound": seconds / bound_s,  # the figure: against one copy (one disk round trip)
        "copies": copies,
        "times_method_bound": seconds / (copies * bound_s),  # against the copies the method must make
        # CPU seconds of this process (for direct not the object store's): robust to other processes' load
        "cpu_s": cpu_s,
        "cpu_times_bound": cpu_s / bound_cpu_s if baseline == "memcpy" else None,
    })
  return rows


def _run_wait(workdir, steps, model_args):
  """A local-backend `jaxrl-hex train` run from fresh weights (sync costs the same whatever the
  values) -> the share of its step time the trainer waited on sync."""
  from jaxrl_hex import cli
  from jaxrl_hex.metrics import read_jsonl
  code = cli.main([
      "train", f"--workdir={workdir}", "--config.sft.max_steps=0", "--config.sft.eval_size=8",
      "--config.train.eval_size=8", f"--config.train.steps={steps}", "--config.train.eval_every=100000",
      "--config.train.checkpoint_every=100000", *model_args
  ])
  assert code == 0, f"train exited {code}"
  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") == "train" and "loss" in r]
  rows = rows[2:]  # past the first steps' compiles
  spans = [s for s in read_jsonl(os.path.join(workdir, "spans.jsonl")) if s["pool"] == "train" and s["kind"] == "sync"]
  period = (rows[-1]["wall_s"] - rows[0]["wall_s"]) / (len(rows) - 1)
  waited = float(np.mean([r["sync_seconds"] for r in rows[1:]]))
  publish_span = float(np.median([s["end"] - s["start"] for s in spans[3:]]))
  return {
      "step_s": period,
      "sync_wait_s": waited,  # the publish call + the step's wait for the previous publish's copy
      "wait_share": waited / period,
      "publish_span_s": publish_span,  # the orchestrator's publish span: + fingerprint (every 20) and offer
      "publish_span_share": publish_span / period,
  }


def bench_wait(steps):
  """The trainer's wait on sync, as a share of its step time: the default run, and the same with
  the 128 MB model of the sync part (the arith task's vocabulary)."""
  big = [f"--config.model.{k}={v}" for k, v in MODEL.items() if k != "vocab_size"]
  runs = (("default", []), ("128MB", big), ("128MB stacked", big + ["--config.model.scan_layers=True"]))
  with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
    return {name: _run_wait(os.path.join(tmp, name.replace(" ", "_")), steps, args) for name, args in runs}


def readme_text(sync, wait):
  lines = [
      "| method | params | seconds | trainer waits | GB/s | baseline (same run) | ours / baseline | x one copy | "
      "copies made | x those copies | CPU s, x one copy's |", "|---|---|---|---|---|---|---|---|---|---|---|"
  ]
  names = {
      "device_put": "device_put (one runtime)",
      "direct": "direct (Ray object store)",
      "direct shared memory": "direct (shared memory, one host)",
      "orbax": "orbax (save + restore onto the rollout layout)"
  }
  for r in sync:
    base = "memcpy" if r["baseline"] == "memcpy" else "disk write+fsync+read"
    lines.append(f"| {names[r['method']]} | {r['params']} ({r['leaves']} leaves) | {r['seconds']:.3f} | "
                 f"{r['publish_s']:.3f} | {r['gb_per_s']:.2f} | "
                 f"{base} {r['baseline_gb_per_s']:.2f} GB/s | {r['ratio_to_baseline']:.2f}x | {r['times_bound']:.2f} | "
                 f"{r['copies']} | {r['times_method_bound']:.2f} | {r['cpu_s']:.3f}" +
                 (f", {r['cpu_times_bound']:.2f}x |" if r["cpu_times_bound"] is not None else " |"))
  if wait:
    lines += [
        "", "| run (local backend, device_put) | step period | trainer waits on sync | share | "
        "publish span (+ fingerprint, offer) | share |", "|---|---|---|---|---|---|"
    ]
    for name, w in wait.items():
      lines.append(f"| {name} | {w['step_s']:.3f} s | {1e3 * w['sync_wait_s']:.2f} ms | {100 * w['wait_share']:.2f}% | "
                   f"{1e3 * w['publish_span_s']:.2f} ms | {100 * w['publish_span_share']:.2f}% |")
  return "\n".join(lines)


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
  parser.add_argument("--rounds", type=int, default=5, help="sync part: rounds of every method, the best kept")
  parser.add_argument("--wait-steps", type=int, default=10, help="train steps of each trainer-wait run (sync part)")
  parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "out", "cluster.json"))
  parser.add_argument("--readme", action="store_true", help="rewrite the cluster-sync block of benchmarks/README.md")
  args = parser.parse_args()
  out = {}
  if args.part in ("sync", "all"):
    out["sync"] = bench_sync(args.rounds)
    for r in out["sync"]:
      print(f"sync {r['method']:>10}, {r['params']:>9}: {r['seconds']*1e3:7.1f} ms "
            f"(trainer waits {r['publish_s']*1e3:.1f} ms) "
            f"{r['gb_per_s']:6.2f} GB/s = {r['ratio_to_baseline']:.2f}x {r['baseline']} ({r['baseline_gb_per_s']:.2f} "
            f"GB/s), {r['times_bound']:.2f}x one copy, {r['times_method_bound']:.2f}x its {r['copies']}; CPU "
            f"{r['cpu_s'] * 1e3:.1f} ms" +
            (f" = {r['cpu_times_bound']:.2f}x one copy's" if r["cpu_times_bound"] else ""))
    out["sync_wait"] = bench_wait(args.wait_steps) if args.wait_steps else {}
    for name, w in out["sync_wait"].items():
      print(f"trainer wait on sync, {name}: {1e3 * w['sync_wait_s']:.2f} ms of {w['step_s']:.3f} s/step = "
            f"{100 * w['wait_share']:.2f}%")
    if args.readme:
      from readme_section import write_section
      write_section("cluster-sync", readme_text(out["sync"], out["sync_wait"]), "Weight sync")
  if args.part in ("async", "all"):
    out["async"] = bench_async(args.steps)
    a = out["async"]
    print(f"async: eta=0 {a['sync']['seconds_per_step']:.3f} s/step, eta=2 {a['async']['seconds_per_step']:.3f} "
          f"s/step -> {a['speedup']:.2f}x; reward (last quarter) {a['reward_tail_mean']}")
  os.makedirs(os.path.dirname(args.json), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=2)


if __name__ == "__main__":
  from jaxrl_hex.host_memory import restart_with_tunables
  restart_with_tunables()  # with glibc's tunables, as the jaxrl-hex program starts (jaxrl_hex/host_memory.py)
  main()
