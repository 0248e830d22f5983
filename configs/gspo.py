"""GSPO (Zheng et al. 2025): the sequence-level importance ratio exp(mean_t log u_t) clipped in a
narrow band (the paper's 3e-4 / 4e-4 scaled up 10x for 2-4 token answers), sequence-level
behaviour weight, two minibatch updates per step (so the ratio moves off 1 and the clip acts).
Over configs/arith_grpo.py."""
import os

from jaxrl_hex.config import load_config_file


def get_config():
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "arith_grpo.py"))
  cfg.algo.update(
      dict(advantage="grpo", loss="gspo", loss_agg="seq-mean-token-mean", clip_eps_low=3e-3, clip_eps_high=4e-3,
           behav_weight_level="sequence", minibatches=2, kl_coef=0.0))
  return cfg
