"""GRPO on GSM8K-style math with LoRA adapters on a Hugging Face model: the base stays frozen (and
in bf16), rank-32 fp32 adapters on every attention and MLP projection are trained, checkpointed
and synced; the KL reference is the base itself. Export the adapters for PEFT, or the merged model:

  jaxrl-hex train --config=configs/gsm8k_grpo_lora.py --config.model_dir=/models/Qwen2.5-Math-1.5B \\
      --config.task_args.train_file=gsm8k/train.jsonl --config.task_args.eval_file=gsm8k/test.jsonl \\
      --config.mesh_file=meshes/<your accelerators>.yaml --workdir=runs/gsm8k_lora
  jaxrl-hex convert --to-peft=runs/gsm8k_lora --out=runs/gsm8k_lora/adapter   # PEFT adapter
  jaxrl-hex convert --to-hf=runs/gsm8k_lora --out=runs/gsm8k_lora/hf          # merged model
"""
import os

from jaxrl_hex.config import load_config_file


def get_config():
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "gsm8k_grpo.py"))
  cfg.model.param_dtype = "bfloat16"  # the frozen base; adapters are float32 whatever this says
  cfg.model.lora.update(rank=32, alpha=64.0)
  cfg.optim.update(lr=2e-5)  # adapters: a step size about 10x full fine-tuning's 1e-6 ... 3e-6
  return cfg
