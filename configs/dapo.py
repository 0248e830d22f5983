"""DAPO (Yu et al. 2025): clip-higher, token-mean loss, dynamic sampling (zero-variance groups
dropped, more prompts sampled until the batch is full), soft overlong punishment, no KL.
Over configs/arith_grpo.py (max_new_tokens 6: lengths 5 and 6 are punished)."""
import os

from jaxrl_hex.config import load_config_file


def get_config():
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "arith_grpo.py"))
  cfg.algo.update(
      dict(advantage="grpo", loss="ppo", loss_agg="token-mean", clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0,
           dynamic_sampling=True, dynamic_sampling_max_rounds=4, overlong_buffer=2, overlong_penalty=1.0))
  return cfg
