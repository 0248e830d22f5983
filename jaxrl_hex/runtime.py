"""What every command builds first: the task, the mesh file and the policy, checked against
each other. Pools (which need devices) are built on first use, in whichever JAX runtime asks."""
import dataclasses
import typing

from jaxrl_hex import meshes
from jaxrl_hex.config import ConfigError, resolve_path, validate
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.config import model_config
from jaxrl_hex.tasks import load_task


@dataclasses.dataclass
class Runtime:
  cfg: typing.Any
  task: typing.Any
  mesh_file: meshes.MeshFile
  policy: Policy
  own_runtime: bool = False  # a Ray worker: its pool is the whole runtime, device ids count from 0
  _pools: dict = dataclasses.field(default_factory=dict)

  @property
  def tokenizer(self):
    return self.task.tokenizer

  def pool(self, role: str) -> meshes.Pool:
    if role not in self._pools:
      spec = self.mesh_file.pools[role]
      if self.own_runtime:
        spec = dataclasses.replace(spec, device_ids=tuple(range(len(spec.device_ids))))
      self._pools[role] = meshes.Pool(spec)
    return self._pools[role]

  @property
  def pools(self) -> dict:
    return {role: self.pool(role) for role in self.mesh_file.pools}

  def shardings(self, role: str):
    """The policy's params laid out on `role`'s pool."""
    return self.pool(role).shardings_for(self.policy.logical_axes(), self.policy.shapes())


def load_mesh(cfg):
  return meshes.load_mesh_file(resolve_path(cfg.mesh_file))


def build_runtime(cfg, own_runtime=False) -> Runtime:
  mesh_file = load_mesh(cfg)
  if cfg.get("model_dir"):  # the architecture is the checkpoint's config.json; precision stays the run's
    from jaxrl_hex.models.hf import hf_model_config
    with cfg.unlocked():
      cfg.model = hf_model_config(resolve_path(cfg.model_dir), dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
  task = load_task(cfg.task, cfg)
  if cfg.model.vocab_size == 0:  # "auto": the task tokenizer's size, rounded up so it shards
    with cfg.unlocked():
      cfg.model.vocab_size = -(-task.tokenizer.vocab_size // 8) * 8
  validate(cfg, mesh_file, task.tokenizer)
  try:
    policy = Policy.build(model_config(**cfg.model))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  for spec in mesh_file.pools.values():  # a parameter that cannot shard fails here, not inside jit
    spec.check_shardable(policy.logical_axes(), policy.shapes())
  return Runtime(cfg, task, mesh_file, policy, own_runtime)
