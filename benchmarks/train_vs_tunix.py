"""Trainer against Tunix (google-tunix 0.1.7, its own venv: bash benchmarks/setup_tunix.sh), one run,
the same tiny Qwen3-like model (vocab 512, d_model 256, 4 layers, 4 query / 2 KV heads, head_dim 64,
MLP 1024, tied embeddings, fp32) on 8 simulated CPU devices, train pool 0-3, rollout pool 4-7:

  W3  one GRPO AdamW step on 64 sequences x 96 tokens (32 prompt + 64 completion): train tokens/s
      vs Tunix's jitted train step (PeftTrainer + grpo_loss_fn).              goal >= 1.2x
  W4  one full GRPO step: 8 prompts x 8 samples, 32-token prompts, 64 new tokens, trivial reward,
      rollout and trainer on different devices: seconds/step vs Tunix's GRPOLearner.   goal >= 2x

  python benchmarks/train_vs_tunix.py [--only w3|w4] [--steps N]  ->  benchmarks/out/train_vs_tunix.json

Each side reports its best (W3) or mean (W4) steady-state step after a compiling first step.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from jaxrl_hex import meshes  # noqa: E402
from jaxrl_hex.config import base_config  # noqa: E402
from jaxrl_hex.models import Policy  # noqa: E402
from jaxrl_hex.models.config import model_config  # noqa: E402
from jaxrl_hex.rl.batch import rl_batch  # noqa: E402
from jaxrl_hex.rl.objectives import make_rl_loss  # noqa: E402
from jaxrl_hex.rl.trainer import Trainer, make_optimizer  # noqa: E402

TINY = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=1024,
            tie_embeddings=True, rope_theta=10000.0)
TUNIX_PY = os.path.join(HERE, ".venv-tunix", "bin", "python")


def pools():
  return meshes.build_pools(meshes.load_mesh_file(os.path.join(os.path.dirname(HERE), "meshes", "cpu-8.yaml")))


def trainer(policy, pool, algo):
  optim = ml_collections.ConfigDict(dict(lr=1e-5, warmup_steps=0, end_lr_ratio=1.0, b1=0.9, b2=0.999,
                                         weight_decay=0.0, grad_clip=1e9))
  return Trainer(policy, pool, make_optimizer(optim, 100), make_rl_loss(algo, 1.0), policy.init(0))


def ours_w3(seqs, prompt, completion, steps):
  policy = Policy.build(model_config(**TINY))
  algo = base_config().algo
  algo.update(dict(loss_agg="token-mean", clip_eps_high=0.2))
  tr = trainer(policy, pools()["train"], algo)
  rng = np.random.default_rng(0)
  n, width = seqs, prompt + completion
  batch = dict(tokens=rng.integers(3, 512, (n, width)).astype(np.int32), valid=np.ones((n, width), bool),
               loss_mask=np.ones((n, completion), bool), behav_logp=np.full((n, completion), -6.0, np.float32),
               rewards=rng.normal(size=n).astype(np.float32), group_ids=np.repeat(np.arange(n // 8), 8).astype(np.int32),
               versions=np.zeros((n, completion), np.int32))
  t0 = time.perf_counter()
  tr.step(batch)
  first = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    tr.step(batch)
    times.append(time.perf_counter() - t0)
  best = min(times)
  return {"step_s": best, "train_tokens_per_s": n * width / best, "first_step_s": first}


class IdTokens:
  """Token-id strings ('17 5 300') as text, so prompts are exact token counts."""
  pad_id, eos_id, bos_id, vocab_size = 0, 1, 2, 512

  def encode(self, text):
    return [int(t) for t in text.split()]

  def decode(self, ids):
    return " ".join(str(int(t)) for t in ids if int(t) not in (0, 1))


def ours_w4(prompts, group, prompt, new, steps):
  """The synchronous GRPO step (eta = 0) on our parts: engine generate on the rollout pool, reward,
  trainer step on the train pool, weight sync onto the rollout layout."""
  from jaxrl_hex.rollout.engine import Engine
  from jaxrl_hex.sync import make_sync
  policy = Policy.build(model_config(**TINY))
  p = pools()
  algo = base_config().algo
  algo.update(dict(clip_eps_high=0.2, loss_agg="seq-mean-token-mean"))   # Tunix GRPO's defaults
  tr = trainer(policy, p["train"], algo)
  rollout_shardings = p["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  sync = make_sync("device_put", policy.shapes(), rollout_shardings, "")
  engine = Engine(policy, p["rollout"], IdTokens(), new, temperature=1.0, slots=prompts * group,
                  max_prompt_len=prompt + 8)
  rng = np.random.default_rng(0)

  def full_step(k):
    engine.load_weights(*sync.receive(sync.publish(*tr.weights())))
    texts = [" ".join(map(str, rng.integers(3, 512, prompt - 1))) for _ in range(prompts)]
    rollout = engine.generate(texts, group, jax.random.key(k))
    rollout.rewards = np.array([len(s) for s in engine.decode(rollout)], np.float32)   # trivial reward
    tr.step(rl_batch(rollout))

  t0 = time.perf_counter()
  full_step(0)
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  for k in range(1, steps + 1):
    full_step(k)
  return {"step_s": (time.perf_counter() - t0) / steps, "first_step_s": first, "steps": steps}


def tunix(which, args):
  if not os.path.exists(TUNIX_PY):
    raise SystemExit(f"{TUNIX_PY} is missing; run: bash benchmarks/setup_tunix.sh")
  out = subprocess.run([TUNIX_PY, os.path.join(HERE, "train_tunix_side.py"), which, json.dumps(args)],
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])["tunix"]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", choices=["w3", "w4"])
  ap.add_argument("--steps", type=int, default=3)
  args = ap.parse_args()
  results = {}
  if args.only in (None, "w3"):
    w3 = dict(seqs=64, prompt=32, completion=64, steps=args.steps)
    ours, theirs = ours_w3(**w3), tunix("w3", w3)
    results["w3"] = {"workload": w3, "ours": ours, "tunix": theirs,
                     "ratio_train_tokens_per_s": ours["train_tokens_per_s"] / theirs["train_tokens_per_s"]}
    print(f"W3 train tokens/s: ours {ours['train_tokens_per_s']:.0f}, tunix {theirs['train_tokens_per_s']:.0f} "
          f"-> {results['w3']['ratio_train_tokens_per_s']:.2f}x (goal >= 1.2x)")
  if args.only in (None, "w4"):
    w4 = dict(prompts=8, group=8, prompt=32, new=64, steps=args.steps)
    ours, theirs = ours_w4(**w4), tunix("w4", w4)
    results["w4"] = {"workload": w4, "ours": ours, "tunix": theirs, "speedup": theirs["step_s"] / ours["step_s"]}
    print(f"W4 seconds/step: ours {ours['step_s']:.2f}, tunix {theirs['step_s']:.2f} "
          f"-> {results['w4']['speedup']:.2f}x faster (goal >= 2x)")
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  with open(os.path.join(HERE, "out", "train_vs_tunix.json"), "w") as f:
    json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
