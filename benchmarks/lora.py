"""LoRA against full fine-tuning, measured in one run: bytes and seconds of one weight sync
(publish on the train pool + receive onto the rollout pool, device_put and Orbax) for the demo
model and a Llama-3.2-1B-shaped model (bf16 base, rank-16 adapters on every projection); train
tokens/s of the same RL batch on the demo model; and the rollout engine serving the adapters
unmerged or merged (rollout.lora_serving): generated tokens/s and the seconds to make a received
version servable. The train-step memory by XLA is benchmarks/lora_memory.py's.

  python benchmarks/lora.py [--out benchmarks/out/lora.json] [--readme]
"""
import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from jaxrl_hex import meshes  # noqa: E402

meshes.prepare_cpu_devices(8)  # before JAX starts, as the CLI does

import jax  # noqa: E402
import numpy as np  # noqa: E402
from readme_section import write_section  # noqa: E402

from jaxrl_hex.config import load_config_file  # noqa: E402
from jaxrl_hex.models.config import model_config  # noqa: E402
from jaxrl_hex.models.policy import Policy  # noqa: E402
from jaxrl_hex.models.tokenizer import CharTokenizer  # noqa: E402
from jaxrl_hex.rl.batch import TrainBatch  # noqa: E402
from jaxrl_hex.rl.objectives import make_rl_loss  # noqa: E402
from jaxrl_hex.rl.trainer import Trainer, make_optimizer  # noqa: E402
from jaxrl_hex.rollout.engine import Engine  # noqa: E402
from jaxrl_hex.sync import make_sync  # noqa: E402
from jaxrl_hex.sync.adapters import AdapterWeights  # noqa: E402

RANK = 16
LLAMA_1B = dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, mlp_dim=8192,
                tie_embeddings=True, rope_theta=500000.0, param_dtype="bfloat16", dtype="bfloat16")


def demo_shape() -> dict:
  model = load_config_file(os.path.join(ROOT, "configs", "arith_grpo.py")).model
  return {
      k: model[k]
      for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "tie_embeddings")
  }


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def sync_seconds(method, policy, params, pools, directory, repeats) -> float:
  """The fastest of `repeats` publish + receive of what a version moves (the trained params)."""
  shapes, targets = (policy.split(t)[0]
                     for t in (policy.shapes(), pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())))
  sync = make_sync(method, shapes, targets, directory)
  best = float("inf")
  for version in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(sync.receive(sync.publish(version, params))[1])
    best = min(best, time.perf_counter() - start)
  return best


def measure_sync(name, shape, pools, repeats) -> list:
  rows = []
  for rank in (0, RANK):
    policy = Policy.build(model_config(**shape, lora=dict(rank=rank, alpha=2.0 * max(rank, 1))))
    shardings = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
    trained = policy.split(policy.init(0, shardings))[0]  # what a publish moves
    for method in ("device_put", "orbax"):
      with tempfile.TemporaryDirectory() as directory:
        seconds = sync_seconds(method, policy, trained, pools, directory, repeats)
      rows.append(dict(model=name, lora_rank=rank, method=method, bytes=nbytes(trained), seconds=seconds))
      print(rows[-1], flush=True)
    del trained
  return rows


def rl_batch(n=256, prompt=8, completion=8, seed=0) -> TrainBatch:
  rng = np.random.default_rng(seed)
  valid = np.ones((n, prompt + completion), bool)
  return TrainBatch(tokens=rng.integers(1, 14, (n, prompt + completion)).astype(np.int32), valid=valid,
                    loss_mask=valid[:, prompt:], behav_logp=np.full(
                        (n, completion), -2.0, np.float32), rewards=rng.integers(0, 2, n).astype(np.float32),
                    group_ids=np.repeat(np.arange(n // 8), 8).astype(np.int32), versions=np.zeros((n, completion),
                                                                                                  np.int32))


def measure_train(pools, steps) -> list:
  """Train tokens/s of the demo's RL batch (32 prompts x 8), full and LoRA, interleaved rounds."""
  cfg = load_config_file(os.path.join(ROOT, "configs", "arith_grpo.py"))
  batch = rl_batch()
  trainers = {}
  for rank in (0, RANK):
    policy = Policy.build(model_config(**dict(cfg.model, lora=dict(rank=rank, alpha=32.0))))
    trainers[rank] = Trainer(policy, pools["train"], make_optimizer(cfg.optim, 1000), make_rl_loss(cfg.algo, 1.0),
                             policy.init(0))
    trainers[rank].step(batch)  # compile
  best = {rank: 0.0 for rank in trainers}
  for _ in range(steps):
    for rank, trainer in trainers.items():
      best[rank] = max(best[rank], trainer.step(batch)["train_tokens_per_s"])
  return [dict(model="demo", lora_rank=rank, train_tokens_per_s=tps) for rank, tps in best.items()]


def measure_serving(pools, rounds) -> list:
  """The demo model's engine on the rollout pool, 32 prompts x 8 samples of 2-digit sums: generated
  tokens/s (best of `rounds` interleaved batches) and seconds from received adapters to servable
  params (unmerged: a dict merge; merged: folding A B into a copy of each targeted weight)."""
  cfg = load_config_file(os.path.join(ROOT, "configs", "arith_grpo.py"))
  policy = Policy.build(model_config(**dict(cfg.model, lora=dict(rank=RANK, alpha=32.0))))
  shardings = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  adapters, base = policy.split(jax.device_put(policy.init(0), shardings))
  tok = CharTokenizer("0123456789+=")
  prompts = [f"{a}+{b}=" for a, b in np.random.default_rng(0).integers(10, 100, (32, 2))]
  engines, best = {}, {}
  for serving in ("unmerged", "merged"):
    weights = AdapterWeights(policy, shardings, serving)
    weights.set_base(None, base)
    params = jax.block_until_ready(weights.assemble(0, adapters))  # compiles the fold (merged)
    start = time.perf_counter()
    jax.block_until_ready(weights.assemble(1, adapters))
    ready_s = time.perf_counter() - start
    engine = Engine(weights.engine_policy, pools["rollout"], tok, max_new_tokens=6, temperature=1.0, slots=256)
    engine.load_weights(0, params)
    engine.generate(prompts, 8, jax.random.key(0))  # compile
    engines[serving], best[serving] = (engine, ready_s), 0.0
  for r in range(rounds):
    for serving, (engine, _) in engines.items():
      tokens, start = engine.tokens_generated, time.perf_counter()
      engine.generate(prompts, 8, jax.random.key(r + 1))
      best[serving] = max(best[serving], (engine.tokens_generated - tokens) / (time.perf_counter() - start))
  return [dict(serving=s, tokens_per_s=best[s], ready_seconds=engines[s][1]) for s in engines]


def table(result) -> str:
  lines = [
      "| model | method | full: MB, ms | LoRA r16: MB, ms | bytes full/LoRA | time full/LoRA |",
      "|---|---|---|---|---|---|"
  ]
  by = {(r["model"], r["method"], r["lora_rank"]): r for r in result["sync"]}
  for model, method, _ in sorted({k for k in by if k[2] == 0}):
    full, adapters = by[(model, method, 0)], by[(model, method, RANK)]
    lines.append(f"| {model} | {method} | {full['bytes'] / 1e6:.2f}, {1e3 * full['seconds']:.1f} | "
                 f"{adapters['bytes'] / 1e6:.3f}, {1e3 * adapters['seconds']:.1f} | "
                 f"{full['bytes'] / adapters['bytes']:.0f}x | {full['seconds'] / adapters['seconds']:.1f}x |")
  train = {r["lora_rank"]: r["train_tokens_per_s"] for r in result["train"]}
  lines += [
      "", "| demo model, RL batch 256 x 16 tokens | full | LoRA r16 | LoRA / full |", "|---|---|---|---|",
      f"| train tokens/s (best of {result['train_steps']} interleaved steps) | {train[0]:,.0f} | {train[RANK]:,.0f} | "
      f"{train[RANK] / train[0]:.2f}x |"
  ]
  serve = {r["serving"]: r for r in result["serving"]}
  lines += [
      "", "| demo model, rollout pool, rank 16 | unmerged | merged | merged / unmerged |", "|---|---|---|---|",
      f"| generated tokens/s (best of {result['serving_rounds']} batches of 32 x 8) | "
      f"{serve['unmerged']['tokens_per_s']:,.0f} | {serve['merged']['tokens_per_s']:,.0f} | "
      f"{serve['merged']['tokens_per_s'] / serve['unmerged']['tokens_per_s']:.2f}x |",
      f"| a received version made servable, ms | {1e3 * serve['unmerged']['ready_seconds']:.2f} | "
      f"{1e3 * serve['merged']['ready_seconds']:.2f} | |"
  ]
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(HERE, "out", "lora.json"))
  parser.add_argument("--readme", action="store_true", help="rewrite the table in benchmarks/README.md")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--train-steps", type=int, default=10, help="also the rounds of the serving comparison")
  parser.add_argument("--serving-only", action="store_true", help="only the serving comparison (printed)")
  args = parser.parse_args()
  pools = meshes.build_pools(meshes.load_mesh_file(os.path.join(ROOT, "meshes", "cpu-8.yaml")))
  if args.serving_only:
    print(measure_serving(pools, args.train_steps))
    return
  result = {"train_steps": args.train_steps, "train": measure_train(pools, args.train_steps)}
  result["serving_rounds"] = args.train_steps
  result["serving"] = measure_serving(pools, args.train_steps)
  result["sync"] = measure_sync("demo", demo_shape(), pools, args.repeats)
  result["sync"] += measure_sync("llama-1b shape, bf16", LLAMA_1B, pools, args.repeats)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(table(result))
  if args.readme:
    write_section("lora", f"`python benchmarks/lora.py --readme` (one run, 2 CPU cores):\n\n{table(result)}",
                  "LoRA against full fine-tuning (benchmarks/lora.py, issue 18)")


if __name__ == "__main__":
  main()
