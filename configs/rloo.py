"""RLOO (Ahmadian et al. 2024): leave-one-out group baseline, PPO-clip, token-mean, no KL.
Over configs/arith_grpo.py."""
import os

from jaxrl_hex.config import load_config_file


def get_config():
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "arith_grpo.py"))
  cfg.algo.update(
      dict(advantage="rloo", loss="ppo", loss_agg="token-mean", clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0))
  return cfg
