"""configs/smollm2_grpo.py with LoRA: rank-16 adapters on every attention and MLP projection, the
base frozen; only the adapters are trained, synced and checkpointed.

  jaxrl-hex train --config=configs/smollm2_grpo_lora.py --workdir=runs/smol_lora
"""
import os

from jaxrl_hex.config import load_config_file


def get_config():
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "smollm2_grpo.py"))
  cfg.model.lora.rank = 16
  # adapters start at zero and carry few parameters: ten times full fine-tuning's step size
  cfg.optim.lr = 1e-4
  return cfg
