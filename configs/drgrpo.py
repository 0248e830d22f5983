"""Dr. GRPO (Liu et al. 2025): GRPO without the std division and without per-sequence length
normalisation (token sums over a constant length), no KL. Over configs/arith_grpo.py."""
import os

from jaxrl_hex.config import load_config_file


def get_config():
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "arith_grpo.py"))
  cfg.algo.update(
      dict(advantage="drgrpo", loss="ppo", loss_agg="seq-mean-token-sum-norm", clip_eps_low=0.2, clip_eps_high=0.2,
           kl_coef=0.0))
  return cfg
