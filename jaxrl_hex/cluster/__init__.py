"""Where the pools run. The orchestrator sees two sides with the same interface whatever the
backend:

  train side    version, meta, step(batch) -> metrics, publish() -> sync.Handle,
                save(meta), describe(), close()
  rollout side  replicas, generate(records, group_size, seed, batch_index, handle) -> Rollout,
                evaluate(records, handle) -> completions, describe(), restarts, close()

`local`: both pools are device subsets of this process's JAX runtime (cluster/local.py).
`ray`: each pool is a group of Ray actors with its own JAX runtime; a multi-process train
pool forms one global mesh with jax.distributed (cluster/ray_backend.py, cluster/workers.py).
"""
from jaxrl_hex.cluster.local import local_sides
from jaxrl_hex.cluster.ray_backend import ray_sides
from jaxrl_hex.errors import ConfigError

# name -> (rt, workdir, resume, recorder) -> (train side, rollout side); Ray's train processes keep their own recorder
BACKENDS = {"local": local_sides, "ray": lambda rt, workdir, resume, recorder: ray_sides(rt, workdir, resume)}


def check_config(cfg):
  """The backend fields against each other, before any work starts; raises ConfigError."""
  backend, method = cfg.cluster.backend, cfg.sync.method
  if backend not in BACKENDS:
    raise ConfigError(f"cluster.backend={backend!r}; use one of {tuple(BACKENDS)}")
  if backend == "local" and method == "direct":
    raise ConfigError("sync.method=direct moves weights through Ray's object store; use it with "
                      "--config.cluster.backend=ray, or device_put / orbax in one process")
  if backend == "ray" and method == "device_put":
    raise ConfigError("sync.method=device_put needs both pools in one JAX runtime; with "
                      "--config.cluster.backend=ray use orbax or direct")


def build_sides(rt, workdir, resume, recorder):
  check_config(rt.cfg)
  return BACKENDS[rt.cfg.cluster.backend](rt, workdir, resume, recorder)
