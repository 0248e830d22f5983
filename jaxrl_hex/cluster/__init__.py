"""Where the pools run. The orchestrator sees two sides with the same interface whatever the
backend:

  train side    version, meta, step(batch) -> metrics, publish() -> sync.Handle,
                save(meta), score(rollout) -> logprobs, fingerprint(always), describe(), close()
  rollout side  replicas, generate(records, group_size, seed, batch_index, handle) -> Rollout,
                evaluate(records, handle) -> completions, probe(prompt, handle) -> [per replica
                {version, rollout, fingerprint}], describe(), restarts, close()

`local`: both pools are device subsets of this process's JAX runtime (cluster/local.py).
`ray`: each pool is a group of Ray actors with its own JAX runtime; a multi-process train
pool forms one global mesh with jax.distributed (cluster/ray_backend.py, cluster/workers.py).
"""
from jaxrl_hex.cluster.local import local_sides
from jaxrl_hex.cluster.ray_backend import ray_sides
from jaxrl_hex.errors import ConfigError

# name -> (rt, workdir, resume, recorder) -> (train side, rollout side); Ray's train processes keep their own recorder
BACKENDS = {"local": local_sides, "ray": lambda rt, workdir, resume, recorder: ray_sides(rt, workdir, resume)}


def check_config(cfg, mesh_file=None):
  """The backend fields against each other and against the mesh file (when given), before any work
  starts and before any device is touched; raises ConfigError."""
  backend, method = cfg.cluster.backend, cfg.sync.method
  if backend not in BACKENDS:
    raise ConfigError(f"cluster.backend={backend!r}; use one of {tuple(BACKENDS)}")
  if mesh_file is not None and backend == "local":
    for role, spec in mesh_file.pools.items():
      if spec.groups:
        raise ConfigError(f"{mesh_file.path}: pools.{role}.replicas holds {len(spec.groups)} replica group(s), each "
                          "replica its own runtime, which the local backend (one runtime) cannot run; use "
                          "--config.cluster.backend=ray (with --config.sync.method=orbax or direct)")
    if mesh_file.platform == "mixed":
      raise ConfigError(f"{mesh_file.path}: platform mixed puts the pools on different platforms, one JAX runtime "
                        "each, which the local backend cannot run; use --config.cluster.backend=ray")
  if backend == "local" and method == "direct":
    raise ConfigError("sync.method=direct moves weights through Ray's object store; use it with "
                      "--config.cluster.backend=ray, or device_put / orbax in one process")
  if backend == "ray" and method == "device_put":
    raise ConfigError("sync.method=device_put needs both pools in one JAX runtime; with "
                      "--config.cluster.backend=ray use orbax or direct")


def build_sides(rt, workdir, resume, recorder):
  check_config(rt.cfg)
  return BACKENDS[rt.cfg.cluster.backend](rt, workdir, resume, recorder)
