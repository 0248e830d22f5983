"""A multi-turn environment (jaxrl_hex/tasks/guess.py): find a number in 1-31 from higher/lower
answers within 6 guesses.

The warm start imitates binary search until held-out success reaches sft.target_accuracy; GRPO
then learns from the episodes' rewards. Each answer is one token of context between the turns.

jaxrl-hex train --config=configs/guess_grpo.py --workdir=runs/guess
"""
import ml_collections

from jaxrl_hex.config import base_config


def get_config():
  cfg = base_config()
  cfg.task = "guess"
  cfg.task_args = ml_collections.ConfigDict({"top": 31})
  cfg.model.update(
      dict(vocab_size=24, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=256,
           tie_embeddings=True))
  cfg.rollout.update(max_prompt_len=8, max_new_tokens=32, turn_tokens=4, kv_page_size=8)
  cfg.sft.update(target_accuracy=0.3, eval_every=10, eval_size=31)
  cfg.optim.update(lr=1e-3)  # few, short episodes per record: a larger step than the default 3e-4
  cfg.train.update(steps=100, eval_every=10, eval_size=31)
  return cfg
