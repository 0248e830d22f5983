"""The Ray backend, driver side: the train pool is a group of TrainWorker actors forming one
multi-controller JAX runtime; the rollout pool is `replicas` RolloutWorker actors, each its own
runtime. Trajectories and weight handles travel through Ray.

A rollout worker that dies or runs past cluster.worker_timeout_s is replaced, and the batch it
held is generated again by the replacement with the newest weights: prompts are bound to a
batch before generation, so each is consumed exactly once. A train process that dies or runs
past cluster.train_timeout_s stops the run (RunStopped); --resume continues it from the last
checkpoint with a fresh cluster.
"""
import queue
import socket
import threading

from jaxrl_hex.cluster.local import sync_directory
from jaxrl_hex.cluster.workers import RolloutWorker, TrainWorker
from jaxrl_hex.errors import RunStopped, UserError
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


def check_cluster(mesh_file):
  """A mesh file must not ask for more hosts or accelerators than the cluster has."""
  import ray
  nodes = [n for n in ray.nodes() if n.get("Alive")]
  resources = ray.cluster_resources()
  for role, spec in mesh_file.pools.items():
    if spec.hosts > len(nodes):
      raise UserError(f"{mesh_file.path}: pools.{role} spans {spec.hosts} hosts but the Ray cluster has "
                      f"{len(nodes)} node(s); lower hosts or add nodes")
  for kind, key in (("gpu", "GPU"), ("tpu", "TPU")):
    want = sum(
        len(s.device_ids) * s.replicas for s in mesh_file.pools.values()
        if (s.device_type or mesh_file.platform).lower().startswith(kind) or mesh_file.platform == kind)
    if want and resources.get(key, 0) < want:
      raise UserError(f"{mesh_file.path}: the pools need {want} {key}s but the Ray cluster has "
                      f"{int(resources.get(key, 0))}; shrink the pools or add {key} nodes")


def _unwrap(error):
  """A worker's own exception (e.g. a UserError) instead of Ray's wrapper."""
  import ray
  if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, UserError):
    return error.cause
  return error


def _actor(cls, spec, **extra):
  import ray
  options = {"num_cpus": 0, **extra, **spec.ray_options}  # scheduling only; pinning is `affinity`
  return ray.remote(cls).options(**options)


class RayTrainSide:

  def __init__(self, rt, workdir, resume):
    import ray

    spec = rt.mesh_file.pools["train"]
    cfg_json = rt.cfg.to_json_best_effort()
    self.method = rt.cfg.sync.method
    cls = _actor(TrainWorker, spec)
    self.workers = [cls.remote(cfg_json, workdir, resume, i, spec.processes) for i in range(spec.processes)]
    coordinator = ray.get(self.workers[0].coordinator_address.remote())
    try:
      started = ray.get([w.start.remote(coordinator) for w in self.workers])[0]
    except ray.exceptions.RayTaskError as e:
      raise _unwrap(e) from None
    self.version, self.meta, self.warmstart = started["version"], started["meta"], started["warmstart"]
    self.sync_seconds = 0.0
    self.mesh, self.workdir, self.timeout = spec.axes, workdir, rt.cfg.cluster.train_timeout_s
    self.lost = False
    self._ray = ray

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
    results = self._all("publish")
    self.sync_seconds = max(seconds for _, seconds in results)
    if self.method == "direct":
      return merge_manifests(self.version, [piece for piece, _ in results])
    return results[0][0]

  def save(self, meta):
    self._all("save", meta)

  def describe(self) -> dict:
    return {"role": "train", "backend": "ray", "mesh": self.mesh, "processes": self._all("describe")}

  def close(self):
    if not self.lost:  # else the survivors may hang in a collective: killing them is the close
      try:
        self._all("close")
      except RunStopped:
        pass
    for w in self.workers:
      self._ray.kill(w)


class RayRolloutSide:

  def __init__(self, rt, workdir):
    import ray

    self._ray = ray
    self.spec = rt.mesh_file.pools["rollout"]
    self.replicas = self.spec.replicas
    self.timeout = rt.cfg.cluster.worker_timeout_s
    self.max_restarts = rt.cfg.cluster.max_restarts
    self._args = (rt.cfg.to_json_best_effort(), workdir)
    self._cls = _actor(RolloutWorker, self.spec, max_concurrency=2)  # offer() lands during generate()
    self.workers = [self._cls.remote(*self._args) for _ in range(self.replicas)]
    try:
      ray.get([w.ready.remote() for w in self.workers])
    except ray.exceptions.RayTaskError as e:
      raise _unwrap(e) from None
    self._free = queue.Queue()
    for i in range(self.replicas):
      self._free.put(i)
    self._lock = threading.Lock()
    self.restarts = 0
    self.on_restart = None

  def _call(self, method, *args):
    """Runs `method` on a free replica; a lost replica is replaced and the call repeated."""
    ray = self._ray
    i = self._free.get()
    try:
      while True:
        worker = self.workers[i]
        try:
          return ray.get(getattr(worker, method).remote(*args), timeout=self.timeout)
        except ray.exceptions.RayTaskError as e:
          raise _unwrap(e) from None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
          self._replace(i, worker)
    finally:
      self._free.put(i)

  def _replace(self, i, worker):
    with self._lock:
      self.restarts += 1
      if self.restarts > self.max_restarts:
        raise RuntimeError(f"rollout workers were lost {self.restarts} times (cluster.max_restarts="
                           f"{self.max_restarts}); see the Ray logs for why they die")
    self._ray.kill(worker, no_restart=True)
    self.workers[i] = self._cls.remote(*self._args)
    self._ray.get(self.workers[i].ready.remote())
    if self.on_restart is not None:
      self.on_restart()

  def offer(self, handle):
    """Every replica gets the newest weights' handle at once, also while it generates: in-flight
    sequences switch at the engine's next hand-back (rollout.interrupt), as in the local backend.
    Fire and forget: a lost replica's replacement starts from the next generate's handle."""
    for worker in self.workers:
      worker.offer.remote(handle)

  def generate(self, records, group_size, seed, batch_index, handle):
    return self._call("generate", records, group_size, seed, batch_index, handle)

  def evaluate(self, records, handle):
    return self._call("evaluate", records, handle)

  def describe(self) -> dict:
    processes = []
    for replica, w in enumerate(list(self.workers)):
      try:
        processes.append(dict(self._ray.get(w.describe.remote(), timeout=30), replica=replica))
      except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
        processes.append({"replica": replica, "lost": True})
    return {"role": "rollout", "backend": "ray", "mesh": self.spec.axes, "processes": processes}

  def close(self):
    for w in self.workers:
      self._ray.kill(w)


def ray_sides(rt, workdir, resume):
  cfg = rt.cfg
  if rt.mesh_file.pools["rollout"].processes != 1:
    raise UserError(f"{rt.mesh_file.path}: pools.rollout.processes must be 1 (each replica is one process); "
                    "use replicas for more rollout runtimes")
  if cfg.sync.method == "orbax":  # fail on an unwritable path before any worker starts
    OrbaxSync(sync_directory(cfg, workdir))
  connect(cfg.cluster.ray_address)
  check_cluster(rt.mesh_file)
  train = RayTrainSide(rt, workdir, resume)
  try:
    rollout = RayRolloutSide(rt, workdir)
  except BaseException:
    train.close()
    raise
  return train, rollout
