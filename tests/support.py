"""Shared by the tests: the repository root and small configs."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(path="configs/arith_grpo.py", **overrides):
  """A config file's get_config() with dotted overrides, as the CLI would apply them."""
  from jaxrl_hex.config import load_config_file
  cfg = load_config_file(os.path.join(ROOT, path))
  cfg.mesh_file = os.path.join(ROOT, "meshes", "cpu-8.yaml")
  for key, value in overrides.items():
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return cfg


SMALL = {
    "rollout.prompts_per_step": 8,
    "rollout.group_size": 4,
    "train.eval_size": 64,
    "train.eval_every": 4,
    "train.log_every": 1,
    "sft.eval_size": 64,
}

# conftest's resumed_run: stopped after step RESUMED_AT, resumed to RESUMED_STEPS
RESUMED_AT, RESUMED_STEPS = 3, 6
