"""PPO with a learned critic: GAE advantages (gamma 1, lambda 0.95, whitened), a value head on a
copy of the policy's trunk (clipped value loss), two minibatch updates per step, PPO-clip,
token-mean. Over configs/arith_grpo.py."""
import os

from jaxrl_hex.config import load_config_file


def get_config():
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "arith_grpo.py"))
  cfg.algo.update(
      dict(advantage="gae", loss="ppo", loss_agg="token-mean", clip_eps_low=0.2, clip_eps_high=0.2, gamma=1.0,
           gae_lambda=0.95, minibatches=2, kl_coef=0.0))
  cfg.algo.critic.update(dict(lr=1e-3, vf_coef=0.5, value_clip=0.2))
  return cfg
