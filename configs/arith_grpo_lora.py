"""The embedded default with LoRA: the same warm start (full fine-tuning of the small decoder),
then GRPO trains rank-16 adapters on every attention and MLP projection while the base stays
frozen; only the adapters are synced to the rollout pool and checkpointed.

jaxrl-hex train --config=configs/arith_grpo_lora.py --workdir=runs/lora
"""
import os

from jaxrl_hex.config import load_config_file


def get_config():
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "arith_grpo.py"))
  cfg.model.lora.update(rank=16, alpha=32.0)
  # adapters start at zero and carry few parameters: a higher step size than full fine-tuning's 3e-4
  cfg.optim.update(lr=2e-3, weight_decay=0.0)
  return cfg
