"""The embedded default: async GRPO on 2-digit addition, train and rollout on different meshes.

jaxrl-hex train --config=configs/arith_grpo.py --config.train.steps=100 --workdir=runs/x
"""
import ml_collections

from jaxrl_hex.config import base_config


def get_config():
  cfg = base_config()
  cfg.task = "arith"
  cfg.task_args = ml_collections.ConfigDict({"digits": 2, "eval_size": 256})
  cfg.model.update(  # over every model field's default, so any of them can be set on the command line
      dict(vocab_size=16, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=256,
           tie_embeddings=True))
  return cfg
