"""REINFORCE++ (Hu 2025): per-token k1 KL penalty in the reward, return-to-go whitened over the
whole batch (no group baseline, works with group size 1), PPO-clip, token-mean.
Over configs/arith_grpo.py."""
import os

from jaxrl_hex.config import load_config_file


def get_config():
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "arith_grpo.py"))
  cfg.algo.update(
      dict(advantage="reinforce_pp", loss="ppo", loss_agg="token-mean", clip_eps_low=0.2, clip_eps_high=0.2,
           kl_coef=0.01, kl_mode="reward", kl_estimator="k1", gamma=1.0))
  return cfg
