"""What every command builds first: the task, the pools, and the policy, checked against each other."""
import dataclasses
import typing

from jaxrl_hex import meshes
from jaxrl_hex.config import ConfigError, resolve_path, validate
from jaxrl_hex.models import Policy
from jaxrl_hex.models.config import model_config
from jaxrl_hex.tasks import load_task


@dataclasses.dataclass
class Runtime:
  cfg: typing.Any
  task: typing.Any
  pools: dict
  policy: Policy

  @property
  def tokenizer(self):
    return self.task.tokenizer


def load_mesh(cfg):
  return meshes.load_mesh_file(resolve_path(cfg.mesh_file))


def build_runtime(cfg) -> Runtime:
  mesh_file = load_mesh(cfg)
  task = load_task(cfg.task, cfg)
  if cfg.model.vocab_size == 0:  # "auto": the task tokenizer's size, rounded up so it shards
    with cfg.unlocked():
      cfg.model.vocab_size = -(-task.tokenizer.vocab_size // 8) * 8
  validate(cfg, mesh_file, task.tokenizer)
  pools = meshes.build_pools(mesh_file)
  try:
    policy = Policy.build(model_config(**cfg.model))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  for pool in pools.values():  # a parameter that cannot shard fails here, not inside jit
    pool.shardings_for(policy.logical_axes(), policy.shapes())
  return Runtime(cfg, task, pools, policy)
