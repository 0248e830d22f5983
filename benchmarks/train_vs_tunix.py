"""Trainer against Tunix (google-tunix 0.1.7, its own venv: bash benchmarks/setup_tunix.sh), one run,
the same tiny Qwen3-like model (vocab 512, d_model 256, 4 layers, 4 query / 2 KV heads, head_dim 64,
MLP 1024, tied embeddings, fp32) on 8 simulated CPU devices, train pool 0-3, rollout pool 4-7:

  W3  one GRPO AdamW step on 64 sequences x 96 tokens (32 prompt + 64 completion): train tokens/s
      vs Tunix's jitted train step (PeftTrainer + grpo_loss_fn).              goal >= 1.2x
  W4  one full GRPO step: 8 prompts x 8 samples, 32-token prompts, 64 new tokens, trivial reward,
      rollout and trainer on different devices: seconds/step of our loop (synchronous, eta 0, and
      async, eta 1) vs Tunix's GRPOLearner (synchronous).                          goal >= 2x
      Twice: on those 2 x 2 meshes, and on one device per pool (train 0, rollout 1: "1+1").

  python benchmarks/train_vs_tunix.py [--only w3|w4] [--steps N]  ->  benchmarks/out/train_vs_tunix.json

Each side reports its best (W3) or mean (W4) steady-state step after a compiling first step; with
--rounds, W4 keeps each side's fastest round (the machine is shared: the least disturbed one).
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
from jaxrl_hex.models.config import model_config  # noqa: E402
from jaxrl_hex.models.policy import Policy  # noqa: E402
from jaxrl_hex.rl.batch import TrainBatch  # noqa: E402
from jaxrl_hex.rl.objectives import make_rl_loss  # noqa: E402
from jaxrl_hex.rl.trainer import Trainer, make_optimizer  # noqa: E402

TINY = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=1024,
            tie_embeddings=True, rope_theta=10000.0)
TUNIX_PY = os.path.join(HERE, ".venv-tunix", "bin", "python")


def pools():
  return meshes.build_pools(meshes.load_mesh_file(os.path.join(os.path.dirname(HERE), "meshes", "cpu-8.yaml")))


def trainer(policy, pool, algo):
  optim = ml_collections.ConfigDict(
      dict(lr=1e-5, warmup_steps=0, end_lr_ratio=1.0, b1=0.9, b2=0.999, weight_decay=0.0, grad_clip=1e9))
  return Trainer(policy, pool, make_optimizer(optim, 100), make_rl_loss(algo, 1.0), policy.init(0))


def grpo_tokens(rng, seqs, prompt, completion, group=8):
  """A GRPO batch: the samples of each group share their prompt."""
  tokens = rng.integers(3, 512, (seqs, prompt + completion)).astype(np.int32)
  tokens[:, :prompt] = np.repeat(tokens[::group, :prompt], group, axis=0)
  return tokens


def ours_w3(seqs, prompt, completion, steps, share_prompts=True):
  policy = Policy.build(model_config(**TINY))
  algo = base_config().algo
  algo.update(dict(loss_agg="token-mean", clip_eps_high=0.2, share_prompts=share_prompts))
  tr = trainer(policy, pools()["train"], algo)
  rng = np.random.default_rng(0)
  n, width = seqs, prompt + completion
  batch = TrainBatch(tokens=grpo_tokens(rng, n, prompt, completion), valid=np.ones((n, width), bool), loss_mask=np.ones(
      (n, completion), bool), behav_logp=np.full((n, completion), -6.0,
                                                 np.float32), rewards=rng.normal(size=n).astype(np.float32),
                     group_ids=np.repeat(np.arange(n // 8), 8).astype(np.int32), versions=np.zeros((n, completion),
                                                                                                   np.int32))
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


def w4_task(config):
  """Prompts of 31 random token ids (32 with BOS), a trivial reward (completion length)."""
  from jaxrl_hex.tasks import Task
  rng = np.random.default_rng(0)
  records = [{
      "prompt": " ".join(map(str, rng.integers(3, 512, config.task_args.prompt - 1))),
      "answer": ""
  } for _ in range(256)]
  return Task("w4", records[8:], records[:8], lambda prompt, completion, answer: float(len(completion)), IdTokens())


MESH_FILES = {"2x2": "cpu-8.yaml", "1+1": "cpu-1-1.yaml"}  # W4 layouts (Tunix's side: train_tunix_side.LAYOUTS)


def ours_w4(prompts, group, prompt, new, steps, eta=0, layout="2x2"):
  """The real loop (commands.train: orchestrator, engine on the rollout pool, trainer on the train
  pool, device_put weight sync) for 2 + steps + 1 GRPO steps; seconds/step from the metrics rows of
  the steady steps (the first two compile, the last evaluates). eta = 0 is synchronous like Tunix."""
  import tempfile

  from jaxrl_hex import commands, tasks
  from jaxrl_hex.metrics import read_jsonl
  tasks.BUILTIN["w4"] = "__main__:w4_task"
  cfg = base_config()
  cfg.mesh_file = os.path.join(os.path.dirname(HERE), "meshes", MESH_FILES[layout])
  cfg.task, cfg.task_args = "w4", ml_collections.ConfigDict({"prompt": prompt})
  cfg.model = ml_collections.ConfigDict(dict(cfg.model, **TINY))
  cfg.rollout.update(dict(prompts_per_step=prompts, group_size=group, max_new_tokens=new, max_prompt_len=prompt + 8))
  cfg.algo.update(dict(clip_eps_high=0.2, loss_agg="seq-mean-token-mean", share_prompts=True))  # Tunix GRPO defaults
  cfg.optim.update(dict(lr=1e-5, warmup_steps=0))
  cfg.sft.update(dict(max_steps=0, eval_size=8))
  cfg.train.update(
      dict(steps=steps + 3, max_staleness=eta, eval_size=8, eval_every=10**6, checkpoint_every=10**6, log_every=10**6))
  workdir = tempfile.mkdtemp(prefix="w4-")
  commands.train(cfg, workdir)
  wall = [
      r["wall_s"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
      if r.get("phase") == "train" and "loss" in r
  ]
  return {
      "step_s": (wall[-2] - wall[1]) / steps,
      "first_steps_s": wall[1] - wall[0] if len(wall) > 1 else None,
      "steps": steps,
      "max_staleness": eta
  }


def tunix(which, args):
  if not os.path.exists(TUNIX_PY):
    raise SystemExit(f"{TUNIX_PY} is missing; run: bash benchmarks/setup_tunix.sh")
  out = subprocess.run([TUNIX_PY, os.path.join(HERE, "train_tunix_side.py"), which,
                        json.dumps(args)], capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])["tunix"]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", choices=["w3", "w4"])
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--rounds", type=int, default=1,
                  help="W4: interleaved rounds (ours, Tunix, ours async); each side's fastest round counts")
  args = ap.parse_args()
  out = os.path.join(HERE, "out", "train_vs_tunix.json")
  results = json.load(open(out)) if os.path.exists(out) else {}  # --only keeps the other workload's figures
  if args.only in (None, "w3"):
    w3 = dict(seqs=64, prompt=32, completion=64, steps=args.steps)
    ours, theirs = ours_w3(**w3), tunix("w3", w3)
    unshared = ours_w3(**w3, share_prompts=False)
    results["w3"] = {
        "workload": w3,
        "ours": ours,
        "ours_without_shared_prompts": unshared,
        "tunix": theirs,
        "ratio_train_tokens_per_s": ours["train_tokens_per_s"] / theirs["train_tokens_per_s"],
        "ratio_without_shared_prompts": unshared["train_tokens_per_s"] / theirs["train_tokens_per_s"]
    }
    print(f"W3 train tokens/s: ours {ours['train_tokens_per_s']:.0f} (without shared prompts "
          f"{unshared['train_tokens_per_s']:.0f}), tunix {theirs['train_tokens_per_s']:.0f} "
          f"-> {results['w3']['ratio_train_tokens_per_s']:.2f}x (goal >= 1.2x)")
  for layout in ("2x2", "1+1") if args.only in (None, "w4") else ():
    w4 = dict(prompts=8, group=8, prompt=32, new=64, steps=args.steps, layout=layout)
    runs = [(ours_w4(**w4), tunix("w4", w4), ours_w4(**w4, eta=1)) for _ in range(args.rounds)]
    sync, theirs, overlapped = (min(side, key=lambda r: r["step_s"]) for side in zip(*runs))
    key = "w4" if layout == "2x2" else "w4_1+1"
    results[key] = {
        "workload": w4,
        "ours_sync": sync,
        "ours_async": overlapped,
        "tunix": theirs,
        "speedup_sync": theirs["step_s"] / sync["step_s"],
        "speedup_async": theirs["step_s"] / overlapped["step_s"]
    }
    print(f"W4 ({layout}) seconds/step: ours {sync['step_s']:.2f} synchronous (eta 0), {overlapped['step_s']:.2f} "
          f"async (eta 1); tunix {theirs['step_s']:.2f} -> {results[key]['speedup_sync']:.2f}x / "
          f"{results[key]['speedup_async']:.2f}x faster (goal >= 2x)")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
