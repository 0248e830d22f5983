"""The Ray backend, driver side: the train pool is a group of TrainWorker actors forming one
multi-controller JAX runtime; the rollout pool is one RolloutWorker actor per replica of its
replica_specs(), each its own runtime with its replica group's layout, device type and pinning.
Trajectories and weight handles travel through Ray.

Batches are routed (cluster/router.py): a batch's prompt groups are spread over the replicas by
their measured throughput, an idle replica takes unstarted groups wherever they are, and the
batch's Rollout comes back once every group is done. A rollout worker that dies or runs past
cluster.worker_timeout_s is replaced with the same layout, and the chunk it held goes back to
the front of the router's queue: every prompt is generated exactly once. A train process that
dies or runs past cluster.train_timeout_s stops the run (RunStopped); --resume continues it from
the last checkpoint with a fresh cluster.
"""
import json
import math
import os
import socket
import threading
import time

import numpy as np

from jaxrl_hex.cluster.local import sync_directory
from jaxrl_hex.cluster.router import Router, prior_shares
from jaxrl_hex.cluster.workers import RolloutWorker, TrainWorker, accelerator_kind
from jaxrl_hex.data.rollouts import concat_rollouts, select_rows
from jaxrl_hex.errors import RunStopped, UserError
from jaxrl_hex.models.policy import param_bytes
from jaxrl_hex.sync import shared_memory
from jaxrl_hex.sync.direct import merge_manifests
from jaxrl_hex.sync.orbax_sync import OrbaxSync


def connect(address: str):
  """Start a local Ray ("") or join a cluster; an unreachable address fails before any work."""
  import ray
  if address and address != "auto":
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
      socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
      raise UserError(f"cluster.ray_address={address!r} is not reachable ({e}); start the cluster "
                      "(ray start --head) or fix the address (host:port, ray://host:port or auto)") from None
  if ray.is_initialized():
    return
  if not address:
    ray.init(include_dashboard=False, log_to_driver=True, configure_logging=False)
    return
  try:
    ray.init(address=address, log_to_driver=True, configure_logging=False)
  except ConnectionError as e:
    raise UserError(f"cluster.ray_address={address!r}: no Ray cluster there ({e}); start one with "
                    "`ray start --head` or leave the address empty for a local Ray") from None


def _demands(mesh_file) -> list:
  """(what, device kind, devices) of every pool, and of every replica group of a rollout pool."""
  out = []
  for role, spec in mesh_file.pools.items():
    if spec.groups:
      for i, g in enumerate(spec.groups):
        kind = accelerator_kind(g.device_type or spec.device_type, mesh_file.platform)
        out.append((f"pools.{role}.replicas[{i}] ({g.device_type or kind} x{g.count})", kind, g.count * g.devices))
    else:
      out.append((f"pools.{role}", accelerator_kind(spec.device_type,
                                                    mesh_file.platform), len(spec.device_ids) * spec.replicas))
  return out


def check_cluster(mesh_file):
  """A mesh file must not ask for more hosts or accelerators than the cluster has; a replica
  group of a kind the cluster lacks is named."""
  import ray
  nodes = [n for n in ray.nodes() if n.get("Alive")]
  resources = ray.cluster_resources()
  for role, spec in mesh_file.pools.items():
    if spec.hosts > len(nodes):
      raise UserError(f"{mesh_file.path}: pools.{role} spans {spec.hosts} hosts but the Ray cluster has "
                      f"{len(nodes)} node(s); lower hosts or add nodes")
  demands = _demands(mesh_file)
  for kind, key in (("gpu", "GPU"), ("tpu", "TPU")):
    have = int(resources.get(key, 0))
    mine = [(what, n) for what, k, n in demands if k == kind]
    if mine and not have:
      raise UserError(f"{mesh_file.path}: {mine[0][0]} needs {mine[0][1]} {key}s but the Ray cluster has no {key}; "
                      f"add {key} nodes or move that group to a device type the cluster has")
    want = sum(n for _, n in mine)
    if want and have < want:
      raise UserError(f"{mesh_file.path}: the pools need {want} {key}s ({', '.join(w for w, _ in mine)}) but the Ray "
                      f"cluster has {have}; shrink the pools or add {key} nodes")


def _unwrap(error):
  """A worker's own exception (e.g. a UserError) instead of Ray's wrapper."""
  import ray
  if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, UserError):
    return error.cause
  return error


def actor_options(spec, environ=os.environ, **extra) -> dict:
  """Ray options of a pool's worker actors. Workers on every node start with the driver's glibc
  tunables (host_memory's huge pages), which glibc reads only when a process starts."""
  options = {"num_cpus": 0, **extra, **spec.ray_options}  # scheduling only; pinning is `affinity`
  if environ.get("GLIBC_TUNABLES"):
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {"GLIBC_TUNABLES": environ["GLIBC_TUNABLES"], **runtime_env.get("env_vars", {})}
    options["runtime_env"] = runtime_env
  return options


def _actor(cls, spec, **extra):
  import ray
  return ray.remote(cls).options(**actor_options(spec, **extra))


class RayTrainSide:
  """The train pool's processes. Made, they start (a restore or a warm start) in the background:
  `starting` holds their start() calls, and up() takes the first one's answer (ray_sides)."""

  def __init__(self, rt, workdir, resume):
    import ray

    spec = rt.mesh_file.pools["train"]
    cfg_json = rt.cfg.to_json_best_effort()
    self.method = rt.cfg.sync.method
    self.sync = self.method + (f" ({rt.cfg.sync.transport})" if self.method == "direct" else "")
    self._base = None  # direct sync with LoRA: the base's Handle (sync/adapters.py)
    self.sync_seconds = 0.0
    self.mesh, self.workdir, self.timeout = spec.axes, workdir, rt.cfg.cluster.train_timeout_s
    self.lost = False
    self._ray = ray
    cls = _actor(TrainWorker, spec)
    self.workers = [cls.remote(cfg_json, workdir, resume, i, spec.processes) for i in range(spec.processes)]
    coordinator = ray.get(self.workers[0].coordinator_address.remote())
    self.starting = [w.start.remote(coordinator) for w in self.workers]

  def up(self, started):
    """started: process 0's answer to start()."""
    self.version, self.meta, self.warmstart = started["version"], started["meta"], started["warmstart"]

  def _all(self, method, *args):
    """`method` on every train process. One lost process cannot be replaced alone (its peers
    hang in collectives waiting for it), so a death, or no answer within train_timeout_s,
    stops the run; the checkpoint on disk is the consistent state to go on from."""
    refs = [getattr(w, method).remote(*args) for w in self.workers]
    pending, ray = list(refs), self._ray
    try:
      while pending:  # wait on whichever finishes first: a dead process's call fails at once
        done, pending = ray.wait(pending, num_returns=1, timeout=self.timeout)
        if not done:
          raise ray.exceptions.GetTimeoutError(f"no answer in {self.timeout:g} s")
        ray.get(done)
      return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
      # a peer's death often surfaces first as a failed collective in a survivor
      if not isinstance(e.cause, UserError) and self._any_died(refs):
        self._stop(method, f"a peer died; the survivors' collectives failed: {str(e.cause).splitlines()[0]}")
      raise _unwrap(e) from None
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
      self._stop(method, f"{type(e).__name__}: {str(e).splitlines()[0]}")

  def _any_died(self, refs, wait_s=10.0) -> bool:
    for ref in refs:
      try:
        self._ray.get(ref, timeout=wait_s)
      except self._ray.exceptions.RayActorError:
        return True
      except (self._ray.exceptions.RayTaskError, self._ray.exceptions.GetTimeoutError):
        continue  # failed, or still hanging in a collective: not a death
    return False

  def _stop(self, method, why):
    self.lost = True
    raise RunStopped(f"a train process was lost during '{method}' ({why}); the run stopped. Continue from its "
                     f"last checkpoint: rerun the same command with --resume --workdir={self.workdir}") from None

  def step(self, batch) -> dict:
    metrics = self._all("step", self._ray.put(batch))[0]
    self.version += 1
    return metrics

  def publish(self):
    # per process: (handle or manifest piece, seconds, fingerprint or None, LoRA base's manifest piece or None)
    results = self._all("publish")
    self.sync_seconds = max(r[1] for r in results)
    if self.method == "direct":
      if results[0][3] is not None:  # the base, published once; its Handle rides on every later one
        self._base = merge_manifests(0, [r[3] for r in results])
      return merge_manifests(self.version, [r[0] for r in results])._replace(fingerprint=results[0][2], base=self._base)
    return results[0][0]

  def save(self, meta):
    self._all("save", meta)

  def score(self, rollout):
    return self._all("score", rollout)[0]  # every process takes part in the pool's program

  def fingerprint(self, always=False):
    return self._all("fingerprint", always)[0]

  def describe(self) -> dict:
    return {"role": "train", "backend": "ray", "mesh": self.mesh, "sync": self.sync, "processes": self._all("describe")}

  def stacks(self) -> dict:
    return worker_stacks(self._ray, {f"train process {i}": w for i, w in enumerate(self.workers)})

  def close(self):
    if not self.lost:  # else the survivors may hang in a collective: killing them is the close
      try:
        self._all("close")
      except RunStopped:
        pass
    self.kill()

  def kill(self):
    for w in self.workers:
      self._ray.kill(w)


def worker_stacks(ray, workers: dict, timeout_s=10.0) -> dict:
  """{name: every thread's stack} of Ray workers (the watchdog's report); an actor busy in a call
  that never returns cannot answer, and that is what its entry says."""
  refs = {name: w.stacks.remote() for name, w in workers.items()}
  out = {}
  for name, ref in refs.items():
    try:
      out[name] = ray.get(ref, timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 -- a dead or busy actor: say which
      out[name] = f"no answer within {timeout_s:g}s ({type(e).__name__}): busy in a call, or gone"
  return out


def _group_options(spec, platform) -> dict:
  """Ray resources of a replica of a replica group (a planner's file has no `ray:` options): its
  accelerators, unless the mesh file's `ray:` says otherwise."""
  kind, options = accelerator_kind(spec.device_type, platform), dict(spec.ray_options)
  if kind == "gpu" and "num_gpus" not in options:
    options["num_gpus"] = len(spec.device_ids)
  if kind == "tpu" and "TPU" not in options.get("resources", {}):
    options["resources"] = dict(options.get("resources", {}), TPU=len(spec.device_ids))
  return options


TOP_UP_WAIT_S = 0.05


def _slots(cfg, share, spec, replicas) -> int:
  """Decode slots of a replica's engine when rollout.slots is auto: the rows of its share of the
  batches in flight (at most eta + 1, and one per replica), rounded to whole groups, so its
  engine stays full while the fleet is (a decode step computes every slot, live or not: a
  replica sized for more than its share pays for rows it never gets), at least one group, a
  multiple of its batch axes."""
  r = cfg.rollout
  if r.slots:
    return r.slots
  in_flight = min(replicas, cfg.train.max_staleness + 1)
  rows = r.group_size * max(1, math.ceil(share * r.prompts_per_step * in_flight - 1e-9))
  ways = spec.batch_ways
  return -(-rows // ways) * ways


class _SpanLog:
  """Appends the rollout side's own spans to WORKDIR/spans.jsonl (as a Ray train process does
  for its rows): per-chunk generate and receive spans, per-batch routing figures."""

  def __init__(self, workdir):
    os.makedirs(workdir, exist_ok=True)
    self._file = open(os.path.join(workdir, "spans.jsonl"), "a")
    self._lock = threading.Lock()

  def span(self, kind, start, end, **extra):
    with self._lock:
      if not self._file.closed:
        self._file.write(json.dumps(dict(pool="rollout", kind=kind, start=start, end=end, **extra)) + "\n")
        self._file.flush()

  def close(self):
    with self._lock:
      self._file.close()


class RayRolloutSide:
  """One RolloutWorker per replica of the rollout pool's replica_specs() (each replica group's own
  layout, device type and pinning), fed by a Router: generate() hands a batch's prompt groups
  to the router and returns once every group is done. One thread per replica keeps its engine
  full: each call on the worker queues the chunks its free slots can start (a group it could not
  start would wait there for a slot while another replica could start it) and runs hand-backs
  until a chunk finishes or slots would idle. Several batches may be in flight (up to
  `replicas`, by the gate) and share a replica's decode steps."""

  def __init__(self, rt, workdir):
    import ray

    self._ray = ray
    self.spec = rt.mesh_file.pools["rollout"]
    self.replica_specs = self.spec.replica_specs()
    self.replicas = len(self.replica_specs)
    groups = self.spec.groups
    self.group_of = [gi for gi, g in enumerate(groups) for _ in range(g.count)] if groups else [0] * self.replicas
    shares = [g.share for g in groups for _ in range(g.count)] if groups else None
    self.timeout = rt.cfg.cluster.worker_timeout_s
    self.max_restarts = rt.cfg.cluster.max_restarts
    self._args = (rt.cfg.to_json_best_effort(), workdir)
    # max_concurrency: offer(), notify() and evaluate() land during an advance()
    self._cls = [
        _actor(RolloutWorker, s, max_concurrency=4, **(_group_options(s, rt.mesh_file.platform) if groups else {}))
        for s in self.replica_specs
    ]
    self.in_flight = min(self.replicas, rt.cfg.train.max_staleness + 1)  # batches the gate lets in at once
    self.slots = [
        _slots(rt.cfg, share, s, self.replicas)
        for share, s in zip(prior_shares(self.replicas, shares), self.replica_specs)
    ]
    self.room = [max(1, n // rt.cfg.rollout.group_size) for n in self.slots]  # groups a replica's engine runs at once
    self.router = Router(self.replicas, shares, capacity=self.room)
    # per replica since the start: tokens, slot-steps (occupancy = their ratio), generation seconds
    # (prefill and the engine's host work included: the speed routing follows) and decode seconds
    # (the decode steps' programs alone: the cost model's decode step, which calibration fits)
    self.decoded = [{"tokens": 0, "slot_steps": 0, "gen_s": 0.0, "decode_s": 0.0} for _ in range(self.replicas)]
    # each replica compiles its engine as it is made (RolloutWorker): `starting` waits for that
    self._made = [time.time()] * self.replicas  # when each replica was asked for: its start span's start
    self.workers = [cls.remote(*self._args, i, self.slots[i]) for i, cls in enumerate(self._cls)]
    self.starting = [w.ready.remote() for w in self.workers]
    self._locks = [threading.Lock() for _ in range(self.replicas)]  # replacing replica i
    self._lock = threading.Lock()
    self._restart_lock = threading.Lock()
    self.restarts = 0
    self.on_restart = None
    self._offered = None  # newest handle offered: a chunk (or a replacement) starts from it
    self._starting = set()  # replicas whose replacement is starting
    self._closing = False
    self._spans = _SpanLog(workdir)
    self._threads = [
        threading.Thread(target=self._serve, args=(i,), name=f"rollout-replica-{i}", daemon=True)
        for i in range(self.replicas)
    ]
    for t in self._threads:
      t.start()

  # ---- replicas -----------------------------------------------------------------------------
  def up(self, i, ready_at):
    """ready_at: replica i's answer to ready(). Its start span runs from the driver asking for the
    replica (its process's launch included) to that."""
    self._spans.span("start", self._made[i], ready_at, replica=i, group=self.group_of[i])

  def _replace(self, i, worker):
    """A lost or hung replica -> a new one with the same layout (the same replica index)."""
    with self._locks[i]:
      if self.workers[i] is not worker or self._closing:  # another caller replaced it already
        return
      with self._lock:
        self.restarts += 1
        if self.restarts > self.max_restarts:
          raise RuntimeError(f"rollout workers were lost {self.restarts} times (cluster.max_restarts="
                             f"{self.max_restarts}); see the Ray logs for why they die")
      self._ray.kill(worker, no_restart=True)
      self._made[i] = time.time()
      self.workers[i] = self._cls[i].remote(*self._args, i, self.slots[i])
      self._starting.add(i)
      try:
        self.up(i, self._ray.get(self.workers[i].ready.remote()))
      finally:
        self._starting.discard(i)
      now = time.time()
      try:
        process = self._ray.get(self.workers[i].describe.remote(), timeout=30)
      except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
        process = {"lost": True}
      self._spans.span("replaced", now, now, replica=i, group=self.group_of[i], process=process)
    with self._restart_lock:  # one rewrite of cluster.json at a time: the last one sees every replacement
      if self.on_restart is not None and not self._closing:
        self.on_restart()

  def _newest(self, handle):
    offered = self._offered
    return offered if offered is not None and offered.version > handle.version else handle

  def _take(self, i, held) -> list:
    """New chunks for replica i, as many groups as its room has beside `held`. Blocks when it
    holds nothing (an empty list then means the router closed); waits TOP_UP_WAIT_S when its
    slots are not full and the gate may still let a batch in, as the next batch is often a moment
    away (its predecessor just finished here), and a call without it returns at the first
    hand-back with free slots (a batch arriving later ends the call through notify)."""
    taken, n = [], sum(len(c.positions) for c, _, _ in held.values())
    while n < self.room[i]:
      if not (held or taken):
        timeout = None
      else:
        coming = self.router.unfinished() < self.in_flight
        timeout = TOP_UP_WAIT_S if coming and not taken else 0
      chunk = self.router.next_chunk(i, most=self.room[i] - n, timeout=timeout)
      if chunk is None:
        break
      taken.append(chunk)
      n += len(chunk.positions)
    return taken

  def _serve(self, i):
    """Replica i's loop: top up its engine from the router, run a hand-back, report what finished;
    a loss gives every chunk it held back."""
    ray = self._ray
    held = {}  # chunk id -> (Chunk, receive spans while it was held, when it was queued)
    while True:
      new = self._take(i, held)
      if not new and not held:
        return
      t0 = time.time()
      for c in new:
        held[c.id] = (c, [], t0)
      worker = self.workers[i]
      handle = self._newest(max((c.context[2] for c, _, _ in held.values()), key=lambda h: h.version))
      try:
        out = ray.get(
            worker.advance.remote([(c.id, c.groups, c.context[0], c.context[1], c.batch) for c in new], handle),
            timeout=self.timeout)
      except ray.exceptions.RayTaskError as e:
        for c, _, _ in held.values():
          self.router.fail(c.batch, _unwrap(e))
          self.router.give_back(c)
        held = {}
        continue
      except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        for c, _, _ in held.values():  # to the front of the queue: every prompt still used exactly once
          self.router.give_back(c)
          self._spans.span("lost", t0, time.time(), replica=i, group=self.group_of[i], batch=c.batch,
                           prompts=len(c.groups))
        held = {}
        if self._closing:
          return
        try:
          self._replace(i, worker)
        except BaseException as e:  # noqa: BLE001 -- too many losses: every waiting batch raises it
          self.router.close(e)
          return
        continue
      t1 = time.time()
      where = {"replica": i, "group": self.group_of[i]}
      for start, end in out["receives"] + out["landed"]:  # landed: received while the engine decoded
        self._spans.span("receive", start, end, version=out["version"], bytes=out["receive_bytes"], **where)
      for _, receives, _ in held.values():
        receives.extend(out["receives"] + out["landed"])
      # speed = slot-steps/s, what the replica could generate full: a decode step costs the same
      # however many slots are live, so tokens/s would rate an underfed replica slow and feed it less.
      # Compiles (none after warmup) and waits for weights are no generation.
      gen_s = out["seconds"] - out["compile_s"] - sum(end - start for start, end in out["receives"])
      slot_steps = out["steps"] * self.slots[i]
      self.router.measure(i, slot_steps, gen_s)
      for key, value in (("tokens", out["tokens"]), ("slot_steps", slot_steps), ("gen_s", gen_s), ("decode_s",
                                                                                                   out["decode_s"])):
        self.decoded[i][key] += value
      for cid, rollout in out["done"]:
        chunk, receives, queued = held.pop(cid)
        self.router.finish(chunk, {"rollout": rollout, "receives": receives}, rollout.num_tokens)
        self._spans.span("generate_chunk", queued, t1, prompts=len(chunk.groups), tokens=rollout.num_tokens,
                         batch=chunk.batch, **where)

  # ---- the rollout side's interface ---------------------------------------------------------
  def offer(self, handle):
    """Every replica gets the newest weights' handle at once, also while it generates: in-flight
    sequences switch at the engine's next hand-back (rollout.interrupt), as in the local backend.
    Fire and forget: a replacement starts from the newest handle at its next chunk."""
    self._offered = handle
    for worker in self.workers:
      worker.offer.remote(handle)

  def generate(self, records, group_size, seed, batch_index, handle):
    """The batch's prompt groups through the router -> (Rollout in the records' order, the span
    over its chunks' weight receives or None, the batch's per-replica figures for its metrics row)."""
    self.router.add_batch(batch_index, list(records), (group_size, seed, handle))
    for worker in self.workers:  # a replica in a hand-back takes its part at the next one, not after its call
      worker.notify.remote()
    results, stats = self.router.wait(batch_index)
    positions = np.concatenate([np.repeat(np.asarray(ps), group_size) for ps, _ in results])  # [N] record of each row
    rollout = select_rows(concat_rollouts([out["rollout"] for _, out in results]), np.argsort(positions, kind="stable"))
    receives = [span for _, out in results for span in out["receives"]]
    span = (min(a for a, _ in receives), max(b for _, b in receives)) if receives else None
    now = time.time()
    for r in stats["replicas"]:
      r["group"] = self.group_of[r["replica"]]
      r["slots"], r["decoded"] = self.slots[r["replica"]], dict(self.decoded[r["replica"]])
    self._spans.span("route", now - stats["seconds"], now, batch=batch_index, replicas=stats["replicas"],
                     shares=self.router.shares())
    return rollout, span, self._row_figures(stats)

  def _row_figures(self, stats) -> dict:
    """A batch's routing in its metrics row: per replica its prompts, tokens, busy and idle
    seconds; and the idle share of the fastest group (by measured slot-steps/s), the figure
    request-level routing drives down."""
    keys = ("replica", "group", "prompts", "tokens", "busy_s", "idle_s")
    replicas = [{k: r[k] for k in keys} for r in stats["replicas"]]
    out = {"rollout_replicas": replicas}
    rates = {}
    for r, rate in enumerate(self.router.rate):
      if rate is not None:
        rates.setdefault(self.group_of[r], []).append(rate)
    if rates and stats["seconds"] > 0:
      fastest = max(rates, key=lambda g: np.mean(rates[g]))
      members = [r for r in replicas if r["group"] == fastest]
      out["rollout_fastest_group"] = fastest
      out["rollout_fastest_idle_share"] = sum(r["idle_s"] for r in members) / (len(members) * stats["seconds"])
    return out

  def evaluate(self, records, handle):
    """Greedy completions on the replica with the largest share (beside its current chunk)."""
    shares = self.router.shares()
    return self._call(max(range(self.replicas), key=lambda r: shares[r]), "evaluate", records, self._newest(handle))

  def probe(self, prompt, handle) -> list[dict]:
    """The weight-sync probe (LocalRolloutSide.probe) on every replica: each has its own layout."""
    return [self._call(i, "probe", prompt, self._newest(handle)) for i in range(self.replicas)]

  def _call(self, i, method, *args):
    """Replica i's `method` beside its current chunk; a lost or hung replica is replaced and asked again."""
    ray = self._ray
    while True:
      worker = self.workers[i]
      try:
        return ray.get(getattr(worker, method).remote(*args), timeout=self.timeout)
      except ray.exceptions.RayTaskError as e:
        raise _unwrap(e) from None
      except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        if self._closing:
          raise RuntimeError(f"the rollout side was closed during {method}") from None
        self._replace(i, worker)

  def occupancy(self, replica) -> float | None:
    """The fraction of the replica's decode slot-steps that generated a token."""
    d = self.decoded[replica]
    return d["tokens"] / d["slot_steps"] if d["slot_steps"] else None

  def stacks(self) -> dict:
    return worker_stacks(self._ray, {f"rollout replica {i}": w for i, w in enumerate(list(self.workers))})

  def describe(self) -> dict:
    """Every replica group with its replicas' processes (pid, host, devices, layout, device type)."""
    processes = []
    for replica, w in enumerate(list(self.workers)):
      try:
        info = self._ray.get(w.describe.remote(), timeout=30)
      except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
        info = {"lost": True}
      processes.append(dict(info, replica=replica, group=self.group_of[replica]))
    stats = self.router.stats
    groups = []
    for gi in sorted(set(self.group_of)):
      members = [r for r in range(self.replicas) if self.group_of[r] == gi]
      spec = self.replica_specs[members[0]]
      g = self.spec.groups[gi] if self.spec.groups else None
      groups.append({
          "group": gi,
          "device_type": spec.device_type,
          "mesh": dict(spec.axes),
          "count": len(members),
          "share": g.share if g is not None else None,
          "processes": [processes[r] for r in members],
          "routed": [dict(stats[r], replica=r, slots=self.slots[r], occupancy=self.occupancy(r)) for r in members],
      })
    return {"role": "rollout", "backend": "ray", "mesh": self.spec.axes, "groups": groups, "processes": processes}

  def close(self):
    with self._restart_lock:  # a cluster.json rewrite in flight ends first; none starts after
      self._closing = True
    self.router.close()
    for i in list(self._starting):  # a replacement still starting comes up (and is logged) before the kill
      self._threads[i].join(timeout=60)
    for w in self.workers:
      self._ray.kill(w)
    for t in self._threads:
      t.join(timeout=10)
    self._spans.close()


def direct_transport(transport, mesh_file, model_bytes) -> str:
  """sync.transport for direct sync: auto -> shared_memory where it can run (one train process, a
  one-node cluster, room in /dev/shm for the versions kept), else object_store; shared_memory where
  it cannot is refused."""
  import ray
  nodes = sum(1 for n in ray.nodes() if n["Alive"])
  processes = mesh_file.pools["train"].processes
  layouts = len({tuple(s.axes.items()) for s in mesh_file.pools["rollout"].replica_specs()})
  need, room = shared_memory.SLOTS * layouts * model_bytes, shared_memory.room()
  problem = ((f"the Ray cluster has {nodes} nodes (every process must share one host)" if nodes > 1 else "") or
             (f"pools.train.processes is {processes} (one train process writes the versions)" if processes > 1 else "")
             or (f"{shared_memory.DIRECTORY} has {room / 2**20:.0f} MiB free of the {need / 2**20:.0f} MiB that "
                 f"{shared_memory.SLOTS} versions on {layouts} rollout layout(s) take" if room < need else ""))
  if transport == "shared_memory" and problem:
    raise UserError(f"sync.transport=shared_memory: {problem}; use --config.sync.transport=object_store")
  return transport if transport != "auto" else "object_store" if problem else "shared_memory"


def ray_sides(rt, workdir, resume):
  cfg = rt.cfg
  if rt.mesh_file.pools["rollout"].processes != 1:
    raise UserError(f"{rt.mesh_file.path}: pools.rollout.processes must be 1 (each replica is one process); "
                    "use replicas for more rollout runtimes")
  if cfg.sync.method == "orbax":  # fail on an unwritable path before any worker starts
    OrbaxSync(sync_directory(cfg, workdir))
  connect(cfg.cluster.ray_address)
  check_cluster(rt.mesh_file)
  if cfg.sync.method == "direct":
    with cfg.unlocked():  # resolved before the workers get the config
      cfg.sync.transport = direct_transport(cfg.sync.transport, rt.mesh_file, param_bytes(rt.policy.shapes()))
  # The pools start side by side: the rollout replicas compile their engines while the train
  # processes join their runtime and restore (or warm-start) the model.
  rollout = RayRolloutSide(rt, workdir)
  try:
    train = RayTrainSide(rt, workdir, resume)
  except BaseException:
    rollout.close()
    raise
  try:
    answers = started(rollout.starting + train.starting)
    for i, answer in enumerate(answers[:rollout.replicas]):
      rollout.up(i, answer)
    train.up(answers[rollout.replicas])
  except BaseException:
    train.kill()  # a process that did not start has nothing to close
    rollout.close()
    raise
  return train, rollout


def started(refs) -> list:
  """The answers to workers' start calls, failing as soon as one fails (with a worker's own
  UserError, not Ray's wrapper)."""
  import ray
  pending = list(refs)
  try:
    while pending:
      done, pending = ray.wait(pending, num_returns=1)
      ray.get(done)
  except ray.exceptions.RayTaskError as e:
    raise _unwrap(e) from None
  return ray.get(refs)
