"""What every command builds first: the task, the mesh file and the policy, checked against the
config and each other before any work starts. Pools (which need devices) are built on first use,
in whichever JAX runtime asks: the driver, or a Ray worker building its own runtime.

The config's single fields are checked in config.py; the checks here need the layers below this
one (the algorithm registry, the sync methods, the mesh file, the task's tokenizer). The backend
checks live with the backends (cluster/__init__.py).
"""
import dataclasses
import typing

from jaxrl_hex import meshes
from jaxrl_hex.config import resolve_path, validate_fields
from jaxrl_hex.errors import ConfigError, UserError
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.hf import hf_model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.rl.objectives import validate_algo
from jaxrl_hex.sync import METHODS
from jaxrl_hex.tasks import load_task

BATCHES = (("train", "rollout.prompts_per_step x rollout.group_size"),
           ("rollout", "rollout.prompts_per_step x rollout.group_size"), ("train", "sft.batch_size"))


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


def validate(cfg, mesh_file=None, tokenizer=None):
  """Every config check that needs no devices; raises ConfigError with a one-line fix."""
  validate_fields(cfg, tokenizer)
  try:
    validate_algo(cfg)
  except UserError as e:
    raise ConfigError(str(e)) from None
  if cfg.sync.method not in METHODS:
    raise ConfigError(f"sync.method={cfg.sync.method!r}; use one of {METHODS}")
  if mesh_file is None:
    return
  for role in ("train", "rollout"):
    if role not in mesh_file.pools:
      raise ConfigError(f"{mesh_file.path}: no '{role}' pool; add pools.{role} with devices and mesh")
  r = cfg.rollout
  sizes = {
      "rollout.prompts_per_step x rollout.group_size": r.prompts_per_step * r.group_size,
      "sft.batch_size": cfg.sft.batch_size
  }
  for role, field in BATCHES:
    ways = mesh_file.pools[role].batch_ways
    if sizes[field] % ways:
      raise ConfigError(f"{field} = {sizes[field]} does not divide the {role} pool's batch axes ({ways} ways); "
                        f"pick a multiple of {ways}")


def load_mesh(cfg) -> meshes.MeshFile:
  return meshes.load_mesh_file(resolve_path(cfg.mesh_file))


def build_runtime(cfg, own_runtime=False) -> Runtime:
  mesh_file = load_mesh(cfg)
  if cfg.get("model_dir"):  # the architecture is the checkpoint's config.json; precision stays the run's
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
