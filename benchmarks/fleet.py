"""A mixed rollout fleet against its own groups alone and against whole-batch dispatch, one run.

On meshes/cpu-mixed.yaml (group 0: one replica of 2 devices at tensor 2 on core 0; group 1: two
single-device replicas on core 1), generation only (no trainer), the same weights and batches
for every configuration, two batches in flight as at eta = 1 (--in-flight). The default workload
is a real fleet's: a batch (16 prompt groups of 8) is larger than one replica's engine (32 slots,
4 groups), so a batch spread over the replicas runs in fewer waves than on any one of them.

  fleet     the Ray rollout side with every replica, batches routed over them by prompt group
  solo g    the same side built from group g alone (its replicas only), timed twice: with the
            other groups' replicas idle, and with them busy on batches of their own ("others
            busy"). The groups of this machine share its caches, memory bandwidth and the cores
            the driver and Ray run on, so a group alone runs faster than it can beside busy
            neighbours; the second sum is the one the fleet can reach here
  batches   today's dispatch: each batch whole on one free replica (a single-replica side per
            replica, a batch to whichever is free), so with 2 in flight one replica waits

  python benchmarks/fleet.py                  ->  benchmarks/out/fleet.json
  python benchmarks/fleet.py --in-flight 1    ->  fleet-1.json
  python benchmarks/fleet.py --slots 0 --prompts 8 --batches 8
      # sessions 5-16's default: engines sized by share (24 slots), a batch of 8 groups
  python benchmarks/fleet.py --per-core       # -> fleet-per-core.json: a replica per core

The routing figures (prompts, busy and idle seconds per replica, the fastest group's idle share)
cover the timed batches only, not the warm-up one.

--per-core keeps the premise of a real fleet on this 2-core machine: every replica has a core of its
own, so a replica that waits leaves its hardware idle (with two replicas on core 1, the one that waits
hands its half core to its sibling, which flatters whole-batch dispatch). Fewer batches in flight
than replicas is then --in-flight 1.
"""
import argparse
import concurrent.futures
import contextlib
import json
import os
import sys
import tempfile
import threading
import time

import ray
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from jaxrl_hex.cluster.ray_backend import RayRolloutSide, started  # noqa: E402
from jaxrl_hex.config import load_config_file  # noqa: E402
from jaxrl_hex.runtime import build_runtime  # noqa: E402
from jaxrl_hex.sync import make_sync  # noqa: E402

MESH = os.path.join(ROOT, "meshes", "cpu-mixed.yaml")
MODEL = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=1024)


def _mesh_with(replicas, tmp) -> str:
  """cpu-mixed.yaml with the rollout side cut to `replicas` ([{group entry}]), shares renormalised."""
  mesh = yaml.safe_load(open(MESH))
  total = sum(g["count"] * g["share"] for g in replicas)
  groups = [dict(g, share=g["share"] / total) for g in replicas]
  mesh["pools"]["rollout"] = {
      "devices": sum(g["count"] * g["mesh"].get("tensor", 1) for g in groups),
      "replicas": groups
  }
  path = os.path.join(tmp, f"mesh-{len(os.listdir(tmp))}.yaml")
  with open(path, "w") as f:
    yaml.safe_dump(mesh, f)
  return path


def _config(mesh_file, args):
  cfg = load_config_file(os.path.join(ROOT, "configs", "arith_grpo.py"))
  cfg.mesh_file, cfg.cluster.backend, cfg.sync.method = mesh_file, "ray", "direct"
  cfg.model.update(MODEL)
  cfg.rollout.update(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.new)
  cfg.rollout.eos_ids = [cfg.model.vocab_size - 1]  # random weights: lengths come from the budget, not EOS
  cfg.train.max_staleness = max(args.in_flight - 1, 0)  # eta = 1: two batches in flight
  cfg.rollout.kv_page_size = args.page
  cfg.rollout.slots = args.slots
  return cfg


def _batches(rt, args):
  records = [dict(r, index=i) for i, r in enumerate(rt.task.train)]
  n = args.prompts
  return [records[k * n:(k + 1) * n] for k in range(args.batches + 1)]  # + 1: the warm-up batch


def _run(generate, batches, args, warm=True):
  """Warm-up batch, then the rest with --in-flight at once -> (tokens/s, seconds)."""
  if warm:
    generate(batches[0], 0)
  t0, tokens = time.perf_counter(), 0
  with concurrent.futures.ThreadPoolExecutor(args.in_flight) as pool:
    for rollout in pool.map(lambda kb: generate(kb[1], kb[0]), enumerate(batches[1:], 1)):
      tokens += rollout.num_tokens
  seconds = time.perf_counter() - t0
  return tokens / seconds, seconds


@contextlib.contextmanager
def _busy(sides, batches, args):
  """Keep `sides` ([(side, handle)]) generating batches of their own until the block ends."""
  stop, errors = threading.Event(), []

  def loop(side, handle):
    k = 0
    try:
      while not stop.is_set():
        k += 1
        side.generate(batches[1 + k % (len(batches) - 1)], args.group, 0, 1000 + k, handle)
    except BaseException as e:  # noqa: BLE001 -- re-raised below: a neighbour that stopped was not busy
      errors.append(e)

  threads = [threading.Thread(target=loop, args=sh) for sh in sides]
  for t in threads:
    t.start()
  try:
    yield
  finally:
    stop.set()
    for t in threads:
      t.join()
  if errors:
    raise RuntimeError("a busy neighbour failed, so the 'others busy' figure is void") from errors[0]


def _busy_seconds(placed, replicas) -> list:
  """Each replica's seconds on the timed whole batches (placed: [(batch, replica, start, end)];
  batch 0 is the warm-up)."""
  return [sum(end - start for k, i, start, end in placed if i == r and k > 0) for r in range(replicas)]


def _side(mesh_file, args, params, tmp):
  cfg = _config(mesh_file, args)
  rt = build_runtime(cfg)
  side = RayRolloutSide(rt, tempfile.mkdtemp(dir=tmp))
  for i, answer in enumerate(started(side.starting)):
    side.up(i, answer)
  handle = make_sync("direct", rt.policy.shapes()).publish(1, params)
  return rt, side, handle


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batches", type=int, default=6)
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--in-flight", type=int, default=2, help="batches generated at once (eta + 1)")
  ap.add_argument("--page", type=int, default=0, help="rollout.kv_page_size (0: the contiguous ring)")
  ap.add_argument("--slots", type=int, default=32, help="rollout.slots of every replica (0: its share's rows)")
  ap.add_argument("--per-core", action="store_true", help="one replica per core: group 1 cut to one replica")
  args = ap.parse_args()
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  tmp = tempfile.mkdtemp()
  groups = yaml.safe_load(open(MESH))["pools"]["rollout"]["replicas"]
  mesh = MESH
  if args.per_core:
    groups = [groups[0], dict(groups[1], count=1, affinity=groups[1]["affinity"][:1])]
    mesh = _mesh_with(groups, tmp)
  rt = build_runtime(_config(mesh, args))
  params = rt.policy.init(0)
  batches = _batches(rt, args)
  results = {}

  _, fleet, handle = _side(mesh, args, params, tmp)
  rows = []  # each timed batch's routing figures, as a run's metrics row has them

  def routed(recs, k):
    rollout, _, row = fleet.generate(recs, args.group, 0, k, handle)
    rows.append(row)
    return rollout

  def per_replica():
    return {r["replica"]: dict(r, group=g["group"]) for g in fleet.describe()["groups"] for r in g["routed"]}

  routed(batches[0], 0)
  rows.clear()
  warm = per_replica()  # the counts since the start: the warm-up batch is taken off below
  results["fleet"] = _run(routed, batches, args, warm=False)
  replicas = [
      dict(r, **{k: r[k] - warm[i][k] for k in ("prompts", "tokens", "busy_s", "idle_s")})
      for i, r in per_replica().items()
  ]
  fleet.close()
  solos = [_side(_mesh_with([g], tmp), args, params, tmp)[1:] for g in groups]
  for gi, (solo, h) in enumerate(solos):
    gen = lambda recs, k, s=solo, h=h: s.generate(recs, args.group, 0, k, h)[0]  # noqa: E731
    results[f"solo group {gi}"] = _run(gen, batches, args)
    with _busy(solos[:gi] + solos[gi + 1:], batches, args):
      results[f"solo group {gi}, others busy"] = _run(gen, batches, args, warm=False)
  for solo, _ in solos:
    solo.close()

  singles = []  # one single-replica side per replica: whole batches, to whichever is free
  for g in groups:
    for i in range(g["count"]):
      one = dict(g, count=1, affinity=[g["affinity"][i]] if g.get("affinity") else [])
      singles.append(_side(_mesh_with([one], tmp), args, params, tmp)[1:])
  free = list(range(len(singles)))
  lock = threading.Semaphore(len(singles))
  guard = threading.Lock()
  placed = []  # (batch, replica, start, end): which replicas whole-batch dispatch kept busy together

  def whole(recs, k):
    with lock:
      with guard:
        i = free.pop(0)
      t0 = time.perf_counter()
      try:
        side, h = singles[i]
        return side.generate(recs, args.group, 0, k, h)[0]
      finally:
        with guard:
          free.append(i)
          placed.append((k, i, t0, time.perf_counter()))

  for side, _ in singles:  # each compiles on its own warm-up batch
    side.generate(batches[0], args.group, 0, 0, singles[0][1])
  results["batches"] = _run(whole, batches, args)
  for side, _ in singles:
    side.close()

  solo_sum = sum(results[f"solo group {gi}"][0] for gi in range(len(groups)))
  busy_sum = sum(results[f"solo group {gi}, others busy"][0] for gi in range(len(groups)))
  fastest = max(replicas, key=lambda r: r["tokens"] / max(r["busy_s"], 1e-9))
  fastest_idle = fastest["idle_s"] / max(fastest["idle_s"] + fastest["busy_s"], 1e-9)
  out = {
      "workload": vars(args),
      "tokens_per_s": {
          k: v[0] for k, v in results.items()
      },
      "seconds": {
          k: v[1] for k, v in results.items()
      },
      "fleet_vs_solo_sum": results["fleet"][0] / solo_sum,
      "fleet_vs_solo_sum_others_busy": results["fleet"][0] / busy_sum,
      "fleet_vs_batch_dispatch": results["fleet"][0] / results["batches"][0],
      "fleet_replicas": replicas,
      "fastest_replica_idle_share": fastest_idle,
      "fastest_group_idle_share_per_batch": [row.get("rollout_fastest_idle_share") for row in rows],
      "batch_dispatch_replica_seconds": _busy_seconds(placed, len(singles)),
  }
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  name = "fleet" + ("-per-core" if args.per_core else "") + ("" if args.in_flight == 2 else f"-{args.in_flight}")
  with open(os.path.join(HERE, "out", name + ".json"), "w") as f:
    json.dump(out, f, indent=2)
  for k, v in results.items():
    print(f"{k:>27}: {v[0]:8.0f} tok/s ({v[1]:.1f} s)")
  print(f"fleet / sum of solo groups {out['fleet_vs_solo_sum']:.2f}x with the others idle, "
        f"{out['fleet_vs_solo_sum_others_busy']:.2f}x with them busy (goal >= 0.9); "
        f"fleet / whole-batch dispatch {out['fleet_vs_batch_dispatch']:.2f}x (goal >= 1.3)")
  for r in replicas:
    print(f"  replica {r['replica']} (group {r['group']}, {r['slots']} slots): {r['prompts']} prompts, busy "
          f"{r['busy_s']:.1f} s, idle {r['idle_s']:.1f} s, slot occupancy {r['occupancy']:.2f}")
  print("whole-batch dispatch, each replica's busy seconds: " +
        ", ".join(f"{s:.1f}" for s in out["batch_dispatch_replica_seconds"]))
  per_batch = [x for x in out["fastest_group_idle_share_per_batch"] if x is not None]
  print(f"fastest replica ({fastest['replica']}) idle {fastest_idle:.0%} of the timed batches' time (goal <= 10%); "
        f"the fastest group's idle share of a batch (metrics rows): mean {sum(per_batch) / len(per_batch):.0%}, "
        f"max {max(per_batch):.0%}")
  ray.shutdown()


if __name__ == "__main__":
  main()
