"""The run config: defaults for every field, and the checks that turn bad input into one line.

Config files are Python (`get_config()` returns an ml_collections.ConfigDict built on
base_config()); any field can be overridden on the command line as --config.a.b=value.
"""
import os

import ml_collections

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.config import DEFAULTS as MODEL_DEFAULTS


class ConfigError(UserError):
  """Bad user input; the message names the field and the fix."""


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mesh_file = "meshes/cpu-8.yaml"
  c.task = "arith"                 # built-in name or path/to/file.py:make_task
  c.task_args = ml_collections.ConfigDict({"digits": 2, "eval_size": 256})
  c.model = ml_collections.ConfigDict(MODEL_DEFAULTS)
  c.init_from = ""                 # a workdir (its latest checkpoint) to start RL from; "" = warm start

  c.sft = ml_collections.ConfigDict(dict(
      max_steps=3000, batch_size=64, target_accuracy=0.4, eval_every=20, eval_size=256,
      lr=3e-3, warmup_steps=50, end_lr_ratio=1.0, b1=0.9, b2=0.98, weight_decay=0.0, grad_clip=1.0))

  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=32, group_size=8, max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0,
      reward_timeout_s=10.0))

  c.algo = ml_collections.ConfigDict(dict(
      clip_eps_low=0.2, clip_eps_high=0.28,         # asymmetric clip (DAPO clip-higher)
      behav_weight_cap=5.0, behav_weight_mode="mask",  # pi_prox/pi_behav above the cap: mask|truncate
      kl_coef=0.0))                                  # > 0 keeps a frozen reference on the train pool

  c.optim = ml_collections.ConfigDict(dict(
      lr=3e-4, warmup_steps=20, end_lr_ratio=0.1, b1=0.9, b2=0.999, weight_decay=0.01, grad_clip=1.0))

  c.train = ml_collections.ConfigDict(dict(
      steps=400, max_staleness=2, eval_every=50, eval_size=256,
      checkpoint_every=100, keep_checkpoints=2, log_every=10))

  c.sync = ml_collections.ConfigDict(dict(method="device_put", directory=""))  # "" = WORKDIR/sync
  return c


def validate(cfg, mesh_file=None, tokenizer=None):
  """Checks that need no JAX; raises ConfigError with a one-line fix."""
  r, a = cfg.rollout, cfg.algo
  if r.group_size < 2:
    raise ConfigError("rollout.group_size must be >= 2 for GRPO: group-normalised advantages of a single sample are always 0")
  if cfg.train.max_staleness < 0:
    raise ConfigError("train.max_staleness must be >= 0 (0 = synchronous, on-policy RL)")
  if r.temperature <= 0:
    raise ConfigError("rollout.temperature must be > 0 for RL sampling; greedy decoding is used for eval only")
  if a.behav_weight_mode not in ("mask", "truncate"):
    raise ConfigError(f"algo.behav_weight_mode={a.behav_weight_mode!r}; use 'mask' or 'truncate'")
  from jaxrl_hex.sync import METHODS
  if cfg.sync.method not in METHODS:
    raise ConfigError(f"sync.method={cfg.sync.method!r}; use one of {METHODS}")
  if tokenizer is not None and cfg.model.vocab_size < tokenizer.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the task tokenizer's "
                      f"{tokenizer.vocab_size}; set --config.model.vocab_size={tokenizer.vocab_size} or more")
  if mesh_file is not None:
    for role in ("train", "rollout"):
      if role not in mesh_file.pools:
        raise ConfigError(f"{mesh_file.path}: no '{role}' pool; add pools.{role} with devices and mesh")
    n = r.prompts_per_step * r.group_size
    for role, size, field in (("train", n, "rollout.prompts_per_step x rollout.group_size"),
                              ("rollout", n, "rollout.prompts_per_step x rollout.group_size"),
                              ("train", cfg.sft.batch_size, "sft.batch_size")):
      ways = mesh_file.pools[role].batch_ways
      if size % ways:
        raise ConfigError(f"{field} = {size} does not divide the {role} pool's batch axes ({ways} ways); "
                          f"pick a multiple of {ways}")


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """A config file's get_config(), as --config=path loads it."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("jaxrl_hex_config", resolve_path(path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def unknown_key_message(cfg, key: str) -> str:
  parent, _, leaf = key.rpartition(".")
  node = cfg
  for part in filter(None, parent.split(".")):
    if part not in node:
      return f"unknown config key {key!r}: {part!r} is not a section; sections: {sorted(cfg.keys())}"
    node = node[part]
  known = sorted(node.keys()) if hasattr(node, "keys") else []
  return f"unknown config key {key!r}; known keys{' under ' + parent if parent else ''}: {', '.join(known)}"


def resolve_path(path: str) -> str:
  """Relative paths resolve against the cwd, then against the repository root."""
  if not path or os.path.isabs(path) or os.path.exists(path):
    return path
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  candidate = os.path.join(root, path)
  return candidate if os.path.exists(candidate) else path
