"""Ray actors: one JAX process each. They wrap the local sides (cluster/local.py), so a pool
computes exactly as it does in one process; only devices and transport differ."""
import os
import socket
import time

import jax
from jax.experimental import multihost_utils

from jaxrl_hex.cluster.local import LocalRolloutSide, LocalTrainSide, make_syncs
from jaxrl_hex.config import config_from_json
from jaxrl_hex.host_memory import keep_freed_memory
from jaxrl_hex.metrics import Recorder, thread_stacks
from jaxrl_hex.planner.catalog import load_catalog
from jaxrl_hex.runtime import build_runtime, load_mesh


def accelerator_kind(device_type, platform) -> str:
  """A mesh file's device type (cpu, gpu, tpu, or a catalog name such as H800 or v5e) -> its
  platform: what Ray schedules the replica on and how its JAX starts."""
  name = (device_type or platform or "cpu").lower()
  for kind in ("cpu", "gpu", "tpu"):
    if name.startswith(kind):
      return kind
  try:
    catalog = {k.lower(): d for k, d in load_catalog().items()}
  except Exception:  # noqa: BLE001 -- an unreadable catalog: fall back to the file's platform
    catalog = {}
  return catalog[name].platform if name in catalog else (platform or "cpu")


def _start_jax(platform, local_devices, affinity, coordinator=None, num_processes=1, process_id=0):
  """Configure this process's JAX before its first operation; join a multi-process runtime."""
  if affinity:  # pin the pool to its own cores, so pools on one machine really run in parallel
    os.sched_setaffinity(0, affinity)
  if platform == "cpu":
    keep_freed_memory()
    jax.config.update("jax_num_cpu_devices", local_devices)
    if num_processes > 1:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if num_processes > 1:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def _describe(process_index=0):
  return {
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "process_index": process_index,
      "local_devices": [d.id for d in jax.local_devices()],
      "cores": sorted(os.sched_getaffinity(0)),  # the pinning (affinity) it runs under
  }


class _NullRecorder:
  t0 = 0.0

  def log(self, row):
    pass

  def span(self, *args, **kwargs):
    pass


class TrainWorker:
  """Process `process_id` of the train pool's runtime."""

  def __init__(self, cfg_json, workdir, resume, process_id, num_processes):
    self.cfg_json, self.workdir, self.resume = cfg_json, workdir, resume
    self.process_id, self.num_processes = process_id, num_processes

  def coordinator_address(self) -> str:
    """host:port on this worker's node for jax.distributed (process 0 serves it)."""
    import ray
    with socket.socket() as s:
      s.bind(("", 0))
      port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"

  def start(self, coordinator) -> dict:
    t0 = time.time()
    cfg = config_from_json(self.cfg_json)
    mesh_file = load_mesh(cfg)
    spec = mesh_file.pools["train"]
    _start_jax(mesh_file.platform,
               len(spec.device_ids) // spec.processes, spec.affinity, coordinator, self.num_processes, self.process_id)
    rt = build_runtime(cfg, own_runtime=True, check_prompts=False)  # the driver checked them
    recorder = Recorder(self.workdir, append=True) if self.process_id == 0 else _NullRecorder()
    self.sync, base_sync = make_syncs(rt, self.workdir, receive=False)
    self.side = LocalTrainSide(rt, self.workdir, self.resume, recorder, self.sync, base_sync)
    self._base_published = False
    recorder.span("train", "start", t0, time.time())  # joined the runtime, restored or warm-started
    return {"version": self.side.version, "meta": self.side.meta, "warmstart": self.side.warmstart}

  def step(self, batch) -> dict:
    return self.side.step(batch)

  def publish(self):
    """orbax: every process writes its shards, -> (Handle, seconds, fingerprint, None); direct: this
    process's manifest piece, and with LoRA at the first publish its piece of the base's manifest."""
    side = self.side
    if side.rt.cfg.sync.method == "direct":
      base = None
      if side.base_sync is not None and not self._base_published:
        base, self._base_published = side.base_sync.publish_local(0, side.trainer.frozen), True
      return self.sync.publish_local(*side.trainer.weights()), self.sync.last_seconds, side.fingerprint(), base
    handle = side.publish()
    return handle, self.sync.last_seconds, handle.fingerprint, None

  def save(self, meta):
    self.side.save(meta)

  def score(self, rollout):
    return self.side.score(rollout)

  def fingerprint(self, always=False):
    return self.side.fingerprint(always)

  def describe(self) -> dict:
    return _describe(self.process_id)

  def stacks(self) -> str:
    return thread_stacks()

  def fetch_params(self):
    """The whole model's params on the host (every process gathers; with LoRA the adapters on their
    base): for checks and exports of small models."""
    return multihost_utils.process_allgather(self.side.trainer.whole(), tiled=True)

  def close(self):
    self.side.close()


class RolloutWorker:
  """Rollout replica `replica`: a single-process runtime with its replica group's layout
  (the rollout pool's replica_specs()[replica]), so weights arrive onto that layout."""

  def __init__(self, cfg_json, workdir, replica=0, slots=None):
    """slots: decode slots for this replica's engine (its routed share of a batch), when
    rollout.slots is auto; None keeps the config's."""
    cfg = config_from_json(cfg_json)
    if slots and not cfg.rollout.slots:
      with cfg.unlocked():
        cfg.rollout.slots = int(slots)
    mesh_file = load_mesh(cfg)
    spec = mesh_file.pools["rollout"].replica_specs()[replica]
    _start_jax(accelerator_kind(spec.device_type, mesh_file.platform), len(spec.device_ids), spec.affinity)
    rt = build_runtime(cfg, own_runtime=True, replica=replica, check_prompts=False)
    self.side = LocalRolloutSide(rt, *make_syncs(rt, workdir, receive=True))
    self.side.warmup()  # before ready: a fresh or replacement replica never compiles mid-batch
    self.replica, self.device_type = replica, spec.device_type
    self._ready_at = time.time()

  def ready(self) -> float:
    """-> when this replica's start ended: its runtime, engine and compiles."""
    return self._ready_at

  def generate(self, records, group_size, seed, batch_index, handle):
    return self.side.generate(records, group_size, seed, batch_index, handle)

  def evaluate(self, records, handle):
    return self.side.evaluate(records, handle)

  def probe(self, prompt, handle) -> dict:
    return self.side.probe(prompt, handle)[0]

  def advance(self, chunks, handle) -> dict:
    """Routed chunks onto the running engine, then one hand-back (LocalRolloutSide.advance) ->
    its {done, tokens, receives, landed} + seconds of the call, compile_s (a new shape's compile is no
    measure of speed), receive_bytes (what this replica's devices hold), version."""
    engine, t0 = self.side.engine, time.perf_counter()
    compiled = engine.compile_seconds
    out = self.side.advance(chunks, handle)
    held = 0
    if out["receives"] or out["landed"]:
      held = sum(s.data.nbytes for leaf in jax.tree.leaves(engine.params) for s in leaf.addressable_shards)
    return dict(out, seconds=time.perf_counter() - t0, compile_s=engine.compile_seconds - compiled, receive_bytes=held,
                version=engine.version)

  def stacks(self) -> str:
    return thread_stacks()

  def describe(self) -> dict:
    pool = self.side.rt.pool("rollout")
    engine = self.side.engine
    return dict(_describe(), replica=self.replica, device_type=self.device_type or pool.describe()["platform"],
                platform=pool.describe()["platform"], mesh=pool.axis_sizes, slots=engine.num_slots,
                compiles=engine.compile_count, compile_s=round(engine.compile_seconds, 3))

  def offer(self, handle):
    """Runs beside generate() (the actor takes two calls at once): the engine picks it up at its
    next hand-back."""
    self.side.offer(handle)

  def notify(self):
    """Runs beside advance(): it returns at its next hand-back to take newly routed work."""
    self.side.notify()

  def receive(self, handle) -> int:
    """Load the weights of `handle` now (otherwise they load at the next generate)."""
    self.side.refresh(self.side.engine, handle)
    return self.side.engine.version

  def fetch_params(self):
    return jax.device_get(self.side.engine.params)
