"""The planner's LoRA train memory against XLA: the trainer's GRPO update compiled (never run) on
simulated CPU devices, full fine-tuning and LoRA side by side at each point, with per-device
peak bytes from memory_analysis() next to planner/cost_model.py's train_memory.

With LoRA the update's state is the adapters and their optimizer state (donated), and the frozen
base is an argument of its own, never donated (rl/trainer.py, compiled by footprint.train_step);
the start pass reads the whole model. The points (POINTS): Qwen2-1.5B and one Qwen2-7B, bf16,
scan_layers, the RL objective of the default config, each remat policy, LoRA and full
fine-tuning at the same step. All run in one process with 8 simulated devices.

  python benchmarks/lora_memory.py [--out benchmarks/out/lora_memory.json]
    -> the JSON and the table (docs/planner.md, "LoRA"); a LoRA point under remat dots also
       prints the cost_model.LORA_DOTS_SAVED_BYTES its peak implies
"""
import argparse
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compile_sizes import device_env, gib, model_cfg, train_rules  # noqa: E402  (benchmarks/ as a script dir)

DEVICES = 8
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (model, train mesh, tokens per row, rows per batch shard, remat, LoRA rank (0: full fine-tuning), LoRA targets)
# yapf: disable
POINTS = (
    ("qwen2_1_5b", {"fsdp": 8}, 4096, 1, "full", 16, ALL),
    ("qwen2_1_5b", {"fsdp": 8}, 4096, 1, "full", 0, ALL),
    ("qwen2_1_5b", {"fsdp": 4, "tensor": 2}, 4096, 1, "full", 16, ALL),
    ("qwen2_1_5b", {"fsdp": 4, "tensor": 2}, 4096, 1, "full", 0, ALL),
    ("qwen2_1_5b", {"fsdp": 8}, 8192, 1, "full", 64, ALL),
    ("qwen2_1_5b", {"fsdp": 8}, 4096, 1, "none", 16, ALL),
    ("qwen2_1_5b", {"fsdp": 8}, 4096, 1, "none", 0, ALL),
    ("qwen2_1_5b", {"fsdp": 8}, 2048, 2, "dots", 16, ALL),
    ("qwen2_1_5b", {"fsdp": 8}, 2048, 2, "dots", 0, ALL),
    ("qwen2_1_5b", {"fsdp": 4, "tensor": 2}, 4096, 1, "dots", 16, ALL),
    ("qwen2_1_5b", {"fsdp": 4, "tensor": 2}, 4096, 1, "dots", 0, ALL),
    ("qwen2_1_5b", {"data": 2, "fsdp": 4}, 8192, 1, "dots", 16, ALL),
    ("qwen2_1_5b", {"fsdp": 8}, 2048, 2, "dots", 16, ("q_proj", "v_proj")),
    ("qwen2_7b", {"fsdp": 8}, 4096, 1, "full", 16, ALL),
)
# yapf: enable


def measure_points() -> list:
  """In a process with DEVICES devices: every POINTS entry's compiled step and the planner's estimate."""
  from jaxrl_hex import footprint, meshes
  from jaxrl_hex.config import base_config
  from jaxrl_hex.models.policy import Policy
  from jaxrl_hex.planner import cost_model as cm
  from jaxrl_hex.rl.objectives import make_rl_loss
  from jaxrl_hex.rl.trainer import make_optimizer
  base, out = base_config(), []
  objective, tx = make_rl_loss(base.algo, 1.0), make_optimizer(base.optim, 100)
  for name, mesh, seq_len, rows, remat, rank, targets in POINTS:
    cfg = model_cfg(name)
    cfg.remat = remat
    cfg.lora.update(rank=rank, targets=targets)
    pool = meshes.Pool(meshes.PoolSpec("train", tuple(range(math.prod(mesh.values()))), mesh, train_rules(False)))
    prompt = min(1024, seq_len // 2)
    batch = footprint.full_batch(pool.batch_ways * rows, prompt, seq_len - prompt, group_size=1)
    step = footprint.train_step(Policy.build(cfg), pool, objective, tx, batch)
    state = step["state"]
    layout = cm.TrainLayout(**{"data": 1, "fsdp": 1, "tensor": 1, **mesh}, remat=remat)
    m = cm.ModelCost.from_config(cfg)
    out.append(
        dict(model=name, mesh=mesh, seq_len=seq_len, rows=rows, remat=remat, lora_rank=rank, lora_targets=targets,
             start=step["start"].as_dict(), update=step["update"].as_dict(), trained_bytes=footprint.sharded_bytes(
                 (state.params, state.opt_state)), frozen_bytes=footprint.sharded_bytes(state.frozen),
             planner_bytes=cm.train_memory(m, layout, seq_len,
                                           rows), adapter_params=m.adapter_params, sync_bytes=m.trained_bytes))
  return out


def dots_elements(p) -> float:
  """What cost_model.LORA_DOTS_SAVED_BYTES multiplies at a LoRA point under remat dots: the adapted
  projections' output elements per device over the micro-batch's tokens and layers; 0 elsewhere."""
  from jaxrl_hex.planner import cost_model as cm
  if not p["lora_rank"] or p["remat"] != "dots":
    return 0.0
  cfg = model_cfg(p["model"])
  cfg.lora.update(rank=p["lora_rank"], targets=tuple(p["lora_targets"]))
  m = cm.ModelCost.from_config(cfg)
  t = p["mesh"].get("tensor", 1)
  return (m.adapted_out_embed + m.adapted_out_wide / t) * m.n_layers * p["rows"] * p["seq_len"]


def table(points) -> str:
  """The points' table; a LoRA point under remat dots also gives the LORA_DOTS_SAVED_BYTES its XLA
  peak implies (the committed constant plus what the planner misses, per element)."""
  from jaxrl_hex.planner import cost_model as cm
  lines = [
      "| model | mesh, rows x tokens, remat | LoRA rank (targets) | trained state GiB/dev | frozen GiB/dev "
      "| update XLA GiB/dev | planner GiB/dev | planner / XLA | implied dots bytes | sync MB |",
      "|---|---|---|---|---|---|---|---|---|---|"
  ]
  for p in points:
    mesh = "x".join(f"{k[0]}{v}" for k, v in p["mesh"].items())
    peak, elements = p["update"]["peak_bytes"], dots_elements(p)
    lora = "full FT" if not p["lora_rank"] else f"{p['lora_rank']} ({len(p['lora_targets'])})"
    implied = f"{cm.LORA_DOTS_SAVED_BYTES + (peak - p['planner_bytes']) / elements:.2f}" if elements else "-"
    lines.append(f"| {p['model']} | {mesh}, {p['rows']} x {p['seq_len']}, {p['remat']} | {lora} "
                 f"| {gib(p['trained_bytes'])} | {gib(p['frozen_bytes'])} | {gib(peak)} | {gib(p['planner_bytes'])} "
                 f"| {p['planner_bytes'] / peak:.2f} | {implied} | {p['sync_bytes'] / 1e6:,.0f} |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.path.join(HERE, "out", "lora_memory.json"))
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the process with DEVICES devices
  args = ap.parse_args()
  if args.worker:
    print(json.dumps(measure_points()))
    return
  done = subprocess.run([sys.executable, __file__, "--worker"], env=device_env(DEVICES), capture_output=True, text=True)
  if done.returncode:
    sys.exit(done.stderr)
  points = json.loads(done.stdout.strip().splitlines()[-1])
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(points, f, indent=2)
  print(table(points))


if __name__ == "__main__":
  main()
