"""GRPO on GSM8K-style math with a Hugging Face model (Qwen2.5-Math-1.5B, Llama-3.2-1B, Gemma-3-1B, ...).

The model directory gives the architecture (config.json), the tokenizer and chat template, and the
first weights; the data is JSONL, one {"question": ..., "answer": "... #### 42"} per line.

  jaxrl-hex train --config=configs/gsm8k_grpo.py --config.model_dir=/models/Qwen2.5-Math-1.5B \\
      --config.task_args.train_file=gsm8k/train.jsonl --config.task_args.eval_file=gsm8k/test.jsonl \\
      --config.mesh_file=meshes/<your accelerators>.yaml --workdir=runs/gsm8k
  jaxrl-hex convert --to-hf=runs/gsm8k --out=runs/gsm8k/hf   # serve with transformers or vLLM
"""
import ml_collections

from jaxrl_hex.config import base_config


def get_config():
  cfg = base_config()
  cfg.task = "jaxrl_hex.tasks.gsm8k:make_task"
  cfg.task_args = ml_collections.ConfigDict(
      dict(
          train_file="",
          eval_file="",  # "" eval_file: hold out eval_size problems of train_file
          eval_size=256,
          chat_template=True,
          system_prompt="",
          eos_token=""))  # "" = the tokenizer's eos_token; a chat model may end turns with another
  cfg.model_dir = ""  # required: a Hugging Face model directory
  cfg.model.dtype = "bfloat16"  # compute; master weights stay float32
  cfg.rollout.update(prompts_per_step=32, group_size=8, max_new_tokens=512, max_prompt_len=384, temperature=1.0)
  cfg.optim.update(lr=1e-6, warmup_steps=10, end_lr_ratio=1.0, weight_decay=0.0)
  cfg.train.update(steps=200, max_staleness=2, eval_every=25, eval_size=256, checkpoint_every=50)
  return cfg
