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
BACKENDS = ("local", "ray")


def build_sides(rt, workdir, resume, recorder):
  from jaxrl_hex.config import ConfigError
  backend = rt.cfg.cluster.backend
  if backend == "local":
    from jaxrl_hex.cluster.local import local_sides
    return local_sides(rt, workdir, resume, recorder)
  if backend == "ray":
    from jaxrl_hex.cluster.ray_backend import ray_sides
    return ray_sides(rt, workdir, resume)
  raise ConfigError(f"cluster.backend={backend!r}; use one of {BACKENDS}")
