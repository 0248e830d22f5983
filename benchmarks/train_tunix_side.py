"""Tunix's side of benchmarks/train_vs_tunix.py; runs under benchmarks/.venv-tunix/bin/python.

  python train_tunix_side.py w3 '{"seqs": 64, "prompt": 32, "completion": 64, "steps": 5}'
  python train_tunix_side.py w4 '{"prompts": 8, "group": 8, "prompt": 32, "new": 64, "steps": 3}'
  python train_tunix_side.py grpo JOB.json RESULT.json '["python", "vs_trl_tunix.py", "--side", "reward", ...]'

w3 and w4 print one JSON line. Their model is Tunix's own Qwen3 at the benchmark's tiny shape; the train
pool is devices 0-3 as (fsdp 2, tp 2), rollout devices 4-7 likewise (8 simulated CPU devices), or
with "layout": "1+1", device 0 and device 1 (meshes/cpu-1-1.yaml on our side).

grpo is benchmarks/vs_trl_tunix.py's Tunix side: its job on a Hugging Face Llama directory through
Tunix's Llama loader, on the 1+1 layout; it writes a SideResult to RESULT.json, the rewards scored by
the command given, which runs in this project's venv.
"""
import json
import os
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


class ChatTokens:
  """A Hugging Face tokenizer.json behind the interface Tunix's sampler uses; the sampler puts
  bos_id before encode(text), as our engine does. pad_id is a token no prompt or completion holds,
  so Tunix's completion mask (tokens != pad) keeps the EOS that ends a completion."""

  def __init__(self, model_dir, bos, eos, pad):
    import tokenizers
    self.tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    self._bos, self._eos, self._pad = bos, eos, pad

  def encode(self, text, **_):
    return self.tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids, **_):
    ids = [int(t) for t in ids]
    return self.tok.decode(ids[:ids.index(self._eos)] if self._eos in ids else ids, skip_special_tokens=True)

  def bos_id(self):
    return self._bos

  def eos_id(self):
    return self._eos

  def pad_id(self):
    return self._pad


def llama_config(model_dir):
  """Tunix's Llama3 ModelConfig from a Hugging Face config.json (Llama architecture only)."""
  from tunix.models.llama3 import model as llama3
  with open(os.path.join(model_dir, "config.json")) as f:
    c = json.load(f)
  if c.get("model_type") != "llama":
    raise ValueError(f"Tunix's Llama loader takes model_type llama; {model_dir} is {c.get('model_type')!r}")
  rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
  if rope.get("rope_type", "default") != "default":
    raise ValueError(f"Tunix's Llama3 applies plain RoPE; {model_dir} scales it ({rope['rope_type']})")
  return llama3.ModelConfig(num_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"], embed_dim=c["hidden_size"],
                            hidden_dim=c["intermediate_size"], num_heads=c["num_attention_heads"],
                            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                            num_kv_heads=c["num_key_value_heads"],
                            rope_theta=int(rope.get("rope_theta") or c.get("rope_theta", 10000)),
                            norm_eps=c["rms_norm_eps"], weight_tying=bool(c.get("tie_word_embeddings")))


class Scorer:
  """The task's reward through a process in this project's venv (vs_trl_tunix.py --side reward)."""

  def __init__(self, cmd):
    import subprocess
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

  def __call__(self, prompts, completions, answers):
    self.proc.stdin.write(json.dumps({"prompts": prompts, "completions": completions, "answers": answers}) + "\n")
    self.proc.stdin.flush()
    return json.loads(self.proc.stdout.readline())["rewards"]

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


def grpo(job_path, result_path, reward_cmd):
  """Tunix's GRPOLearner on vs_trl_tunix.py's Job: train pool device 0, rollout device 1 (as
  meshes/cpu-1-1.yaml), the model from its safetensors through Tunix's Llama loader, fp32."""
  import dataclasses
  import traceback

  from vs_trl_tunix import Job, SideResult, StepTime
  job = Job.load(job_path)
  res = SideResult("tunix")
  scorer = Scorer(json.loads(reward_cmd))
  try:
    run_grpo(job, res, scorer)
  except Exception as e:  # noqa: BLE001 -- why Tunix cannot run the job is the result
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "tunix" in f.filename or "flax" in f.filename]
    where = f" at {frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else ""
    res.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}"
    traceback.print_exc()
  finally:
    scorer.close()
  res.steps = [StepTime(**s) if isinstance(s, dict) else s for s in res.steps]
  with open(result_path, "w") as f:
    json.dump(dataclasses.asdict(res), f)


def run_grpo(job, res, scorer):
  import jax.numpy as jnp
  from tunix.models.llama3 import params as llama3_params
  from vs_trl_tunix import TUNIX_LOSS, StepTime
  train_ids, rollout_ids, shape = LAYOUTS["1+1"]
  train_mesh, rollout_mesh = mesh(train_ids, shape), mesh(rollout_ids, shape)
  config = llama_config(job.model_dir)
  actor = llama3_params.create_model_from_safe_tensors(job.model_dir, config, mesh=train_mesh, dtype=jnp.float32)
  pad = next(i for i in range(config.vocab_size) if i not in (job.bos_id, *job.eos_ids))  # a token no text holds
  tokens = ChatTokens(job.model_dir, job.bos_id, job.eos_ids[0], pad)
  prompt_len = max(len(p.ids) for p in job.train + job.eval)
  schedule = optax.warmup_cosine_decay_schedule(0.0, job.lr, job.warmup_steps, max(job.steps, 2),
                                                job.lr * job.end_lr_ratio)
  optimizer = optax.chain(optax.clip_by_global_norm(job.grad_clip),
                          optax.adamw(schedule, b1=job.b1, b2=job.b2, eps=1e-8, weight_decay=job.weight_decay))
  training = rl_cluster_lib.RLTrainingConfig(actor_optimizer=optimizer, eval_every_n_steps=10**6, max_steps=1,
                                             mini_batch_size=job.prompts_per_step)
  rollout = base_rollout.RolloutConfig(max_tokens_to_generate=job.max_new_tokens, max_prompt_length=prompt_len,
                                       temperature=job.temperature, top_p=job.top_p, top_k=job.top_k or None,
                                       kv_cache_size=prompt_len + job.max_new_tokens + 8, eos_tokens=job.eos_ids)
  cluster = rl_cluster_lib.RLCluster(
      actor=actor, reference=None, tokenizer=tokens, cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={
              rl_cluster_lib.Role.ACTOR: train_mesh,
              rl_cluster_lib.Role.REFERENCE: train_mesh,
              rl_cluster_lib.Role.ROLLOUT: rollout_mesh
          }, rollout_engine="vanilla", offload_to_cpu=False, training_config=training, rollout_config=rollout))
  algo = grpo_learner.GRPOConfig(num_generations=job.group_size, beta=0.0, epsilon=job.clip_eps_low,
                                 loss_agg_mode=TUNIX_LOSS[job.loss_agg])
  algo.epsilon_high = job.clip_eps_high  # not a GRPOConfig field in 0.1.7; its grpo loss reads the attribute

  def reward(prompts, completions, answer, **_):
    return scorer(list(prompts), list(completions), [str(a) for a in answer])

  learner = grpo_learner.GRPOLearner(cluster, algo, reward_fns=reward)
  sampler = cluster.rollout._sampler  # pylint: disable=protected-access
  for p in job.train + job.eval:
    got = [int(t) for t in sampler.tokenize(p.text)]
    if got != p.ids:
      raise ValueError(f"Tunix's sampler tokenizes {p.text!r} to {got}, the engine to {p.ids}")

  clock = {}

  def timed(name, fn):

    def run(*a, **kw):
      t0 = time.perf_counter()
      out = fn(*a, **kw)
      clock[name] = time.perf_counter() - t0
      if name == "gen":
        clock["gen_tokens"] = sum(len(t) for t in out.tokens)
        clock["train_tokens"] = int((np.asarray(out.left_padded_prompt_tokens) != pad).sum()) + clock["gen_tokens"]
      if name == "sync":
        now = time.perf_counter()
        res.steps.append(
            StepTime(
                len(res.steps) + 1, now - clock["last"], clock["gen"], clock["gen_tokens"], clock["train"],
                clock["train_tokens"]))
        if len(res.steps) in job.eval_steps():  # the rollout sampler has this step's weights now
          res.curve.append([len(res.steps), accuracy()])
        clock["last"] = time.perf_counter()  # an evaluation is not part of the next step
      return out

    return run

  cluster.generate = timed("gen", cluster.generate)
  cluster.update_actor = timed("train", cluster.update_actor)
  cluster.sync_weights = timed("sync", cluster.sync_weights)

  def accuracy():
    """Tunix's sampler, greedy (no temperature, top_p or top_k), on the held-out prompts."""
    chunk, scores = job.prompts_per_step * job.group_size, []
    for i in range(0, len(job.eval), chunk):
      part = job.eval[i:i + chunk]
      texts = [p.text for p in part] + [part[-1].text] * (chunk - len(part))  # the train rollout's batch shape
      out = sampler(input_strings=texts, max_generation_steps=job.max_new_tokens, max_prompt_length=prompt_len,
                    eos_tokens=job.eos_ids, temperature=0.0, top_p=None, top_k=None)
      scores += scorer([p.text for p in part], list(out.text[:len(part)]), [p.answer for p in part])
    return sum(scores) / len(scores)

  data = [{
      "prompts": np.array([p.text for p in job.step_prompts(k)]),
      "answer": np.array([p.answer for p in job.step_prompts(k)])
  } for k in range(job.steps)]
  res.curve.append([0, accuracy()])
  training.max_steps = job.steps
  clock["last"] = time.perf_counter()
  learner.train(data)
  res.settings = {"tunix": "0.1.7", "jax": jax.__version__, "pad_id": pad, "rollout_engine": "vanilla"}


if __name__ == "__main__":
  if sys.argv[1] == "grpo":
    grpo(*sys.argv[2:5])
  else:
    which, args = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"tunix": {"w3": w3, "w4": w4}[which](**args)}))
