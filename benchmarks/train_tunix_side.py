"""Tunix's side of benchmarks/train_vs_tunix.py; runs under benchmarks/.venv-tunix/bin/python.

  python train_tunix_side.py w3 '{"seqs": 64, "prompt": 32, "completion": 64, "steps": 5}'
  python train_tunix_side.py w4 '{"prompts": 8, "group": 8, "prompt": 32, "new": 64, "steps": 3}'

Prints one JSON line. The model is Tunix's own Qwen3 at the benchmark's tiny shape; the train
pool is devices 0-3 as (fsdp 2, tp 2), rollout devices 4-7 likewise (8 simulated CPU devices), or
with "layout": "1+1", device 0 and device 1 (meshes/cpu-1-1.yaml on our side).
"""
import json
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl import algo_core, rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.sft import peft_trainer  # noqa: E402

PAD, EOS, BOS = 0, 1, 2
TINY = dict(num_layers=4, vocab_size=512, embed_dim=256, hidden_dim=1024, num_heads=4, head_dim=64, num_kv_heads=2,
            rope_theta=10000, norm_eps=1e-6, use_tied_embedding=True)

LAYOUTS = {"2x2": ((0, 1, 2, 3), (4, 5, 6, 7), (2, 2)), "1+1": ((0,), (1,), (1, 1))}  # train, rollout, shape


def mesh(ids, shape):
  return jax.sharding.Mesh(np.array([jax.devices()[i] for i in ids]).reshape(shape), ("fsdp", "tp"))


def model_on(m):
  with jax.set_mesh(m):
    model = qwen3.Qwen3(qwen3.ModelConfig(**TINY), rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    shardings = jax.tree.map(lambda p: jax.sharding.NamedSharding(m, p or jax.sharding.PartitionSpec()),
                             nnx.get_partition_spec(state))
    return nnx.merge(graph, jax.device_put(state, shardings))


def w3(seqs, prompt, completion, steps, layout="2x2"):
  """Tunix's jitted GRPO train step (PeftTrainer + grpo_loss_fn) on fixed 96-token sequences."""
  train, _, shape = LAYOUTS[layout]
  train_mesh = mesh(train, shape)
  model = model_on(train_mesh)
  algo = grpo_learner.GRPOConfig(num_generations=8, beta=0.0, epsilon=0.2, loss_agg_mode="token-mean")
  algo.temperature = 1.0
  trainer = peft_trainer.PeftTrainer(model, optax.adamw(1e-5), peft_trainer.TrainingConfig(eval_every_n_steps=10**6))
  trainer.with_loss_fn(
      lambda model, train_example, algo_config: algo_core.grpo_loss_fn(model, train_example, algo_config, pad_id=PAD,
                                                                       eos_id=EOS), has_aux=True)
  trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
  rng = np.random.default_rng(0)
  prompts = np.repeat(rng.integers(3, 512, (seqs // 8, prompt)).astype(np.int32), 8, axis=0)  # groups of 8
  example = grpo_learner.TrainExample(prompt_ids=prompts, prompt_mask=np.ones(
      (seqs, prompt),
      bool), completion_ids=rng.integers(3, 512, (seqs, completion)).astype(np.int32), completion_mask=np.ones(
          (seqs, completion), bool), advantages=rng.normal(size=seqs).astype(np.float32), ref_per_token_logps=None,
                                      old_per_token_logps=None)
  with jax.set_mesh(train_mesh):
    step, _ = trainer.jit_train_and_eval_step()
    t0 = time.perf_counter()
    jax.block_until_ready(step(example))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
      t0 = time.perf_counter()
      jax.block_until_ready(step(example))
      times.append(time.perf_counter() - t0)
  best = min(times)
  return {"step_s": best, "train_tokens_per_s": seqs * (prompt + completion) / best, "first_step_s": compile_s}


class Tokens:
  """A tokenizer over token-id strings ('17 5 300'): Tunix needs encode/decode/ids."""

  def encode(self, text, **_):
    return [int(t) for t in text.split()]

  def decode(self, ids, **_):
    return " ".join(str(int(t)) for t in ids if int(t) not in (PAD, EOS))

  def bos_id(self):
    return BOS

  def eos_id(self):
    return EOS

  def pad_id(self):
    return PAD


def w4(prompts, group, prompt, new, steps, layout="2x2"):
  """Tunix's GRPOLearner: generate on the rollout mesh, score, train on the train mesh, sync."""
  train, rollout_ids, shape = LAYOUTS[layout]
  train_mesh, rollout_mesh = mesh(train, shape), mesh(rollout_ids, shape)
  rng = np.random.default_rng(0)
  # an array, not a list: the learner repeats each prompt per sample with tree maps
  data = [{
      "prompts": np.array([" ".join(map(str, rng.integers(3, 512, prompt - 1))) for _ in range(prompts)])
  } for _ in range(steps + 1)]
  training = rl_cluster_lib.RLTrainingConfig(actor_optimizer=optax.adamw(1e-5), eval_every_n_steps=10**6, max_steps=1,
                                             mini_batch_size=prompts)
  rollout = base_rollout.RolloutConfig(max_tokens_to_generate=new, max_prompt_length=prompt, temperature=1.0,
                                       kv_cache_size=prompt + new + 8)
  cluster = rl_cluster_lib.RLCluster(
      actor=model_on(train_mesh), reference=None, tokenizer=Tokens(), cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={
              rl_cluster_lib.Role.ACTOR: train_mesh,
              rl_cluster_lib.Role.REFERENCE: train_mesh,
              rl_cluster_lib.Role.ROLLOUT: rollout_mesh
          }, rollout_engine="vanilla", offload_to_cpu=False, training_config=training, rollout_config=rollout))
  algo = grpo_learner.GRPOConfig(num_generations=group, beta=0.0, epsilon=0.2)
  learner = grpo_learner.GRPOLearner(
      cluster, algo,
      reward_fns=lambda prompts, completions, **_: [float(len(c)) for c in completions])  # trivial reward
  t0 = time.perf_counter()
  learner.train(data[:1])  # first step: compiles
  first = time.perf_counter() - t0
  training.max_steps = 1 + steps
  t0 = time.perf_counter()
  learner.train(data[1:])
  return {"step_s": (time.perf_counter() - t0) / steps, "first_step_s": first, "steps": steps}


if __name__ == "__main__":
  which, args = sys.argv[1], json.loads(sys.argv[2])
  print(json.dumps({"tunix": {"w3": w3, "w4": w4}[which](**args)}))
