"""Small settings for the agentic recipes in tests (the calculator tool task)."""
from support import SMALL, load_config

CALCULATOR = {
    **SMALL,
    "train.eval_size": 32,
    "sft.eval_size": 32,
    "sft.eval_every": 10,
    "task_args.eval_size": 32,
}


def calculator_config(**overrides):
  return load_config("configs/calculator_grpo.py", **{**CALCULATOR, **overrides})
