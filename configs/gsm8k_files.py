"""GRPO on GSM8K-style math read from your own files (JSONL, Parquet, Arrow or a `datasets.save_to_disk`
directory) with a Hugging Face model: the files task (jaxrl_hex/tasks/files.py) with the GSM8K
recipe's prompts and reward, and a field mapping for your columns.

  jaxrl-hex train --config=configs/gsm8k_files.py --config.model_dir=/models/Qwen2.5-Math-1.5B \\
      --config.task_args.train_file='gsm8k/train-*.parquet' --config.task_args.eval_file=gsm8k/test.parquet \\
      --config.task_args.prompt_field=question --config.task_args.answer_field=answer \\
      --config.mesh_file=meshes/<your accelerators>.yaml --workdir=runs/gsm8k

Records are read from the files as the prompt stream draws them (shuffled every epoch, sharded per
host, resumed exactly with --resume). Answers may be full GSM8K solutions ('... #### 42'): the
"math" reward compares final values.
"""
import os

import ml_collections

from jaxrl_hex.config import load_config_file
from jaxrl_hex.tasks.files import ARGS
from jaxrl_hex.tasks.gsm8k import INSTRUCTION


def get_config():
  # the model, rollout, optimiser and schedule of the JSONL recipe
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "gsm8k_grpo.py"))
  cfg.task = "files"
  cfg.task_args = ml_collections.ConfigDict(
      dict(
          ARGS,
          prompt_field="question",
          answer_field="answer",
          instruction=INSTRUCTION,
          prompt_format="Question: {prompt}\nAnswer:",  # without a chat template
          reward="math"))
  return cfg
