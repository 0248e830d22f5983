"""GRPO (DeepSeekMath): group mean/std advantages, symmetric PPO-clip, per-sequence token means,
k3 KL to the frozen warm start in the loss. Over configs/arith_grpo.py.

jaxrl-hex train --config=configs/grpo.py
"""
import os

from jaxrl_hex.config import load_config_file


def get_config():
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "arith_grpo.py"))
  cfg.algo.update(
      dict(advantage="grpo", loss="ppo", loss_agg="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2,
           kl_coef=0.01, kl_mode="loss", kl_estimator="k3"))
  return cfg
