"""A tool task (jaxrl_hex/tasks/calculator.py): 3-digit multiplication with a calculator tool.

The small decoder cannot multiply; it learns to call <calc>a*b</calc> and copy the result. The
warm start imitates such episodes until held-out success reaches sft.target_accuracy, then GRPO
trains on whole episodes (the tool's tokens are context, never trained).

jaxrl-hex train --config=configs/calculator_grpo.py --workdir=runs/calc
"""
import ml_collections

from jaxrl_hex.config import base_config


def get_config():
  cfg = base_config()
  cfg.task = "calculator"
  cfg.task_args = ml_collections.ConfigDict({"digits": 3, "eval_size": 128})
  cfg.model.update(
      dict(vocab_size=0, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=256,
           tie_embeddings=True))
  # an episode: prompt (9 tokens) + call (21) + result (~22) + answer (~7); its KV stays in the
  # engine between turns (paged), so a turn prefills only the tool's result
  cfg.rollout.update(max_prompt_len=16, max_new_tokens=80, turn_tokens=24, kv_page_size=8)
  cfg.sft.update(target_accuracy=0.3, eval_every=5, eval_size=128)
  cfg.train.update(steps=60, eval_every=10, eval_size=128)
  return cfg
