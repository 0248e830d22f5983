"""Every algorithm preset learns: one supervised warm start, then a short async run of each preset
(configs/{grpo,drgrpo,dapo,gspo,rloo,reinforce_pp,ppo}.py) from that same warm start, held-out
greedy accuracy before and after.

  python benchmarks/algos.py [--steps 80] [--presets grpo,ppo]  ->  benchmarks/out/algos.json
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
PRESETS = ["grpo", "drgrpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo"]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=80)
  ap.add_argument("--presets", default=",".join(PRESETS))
  ap.add_argument("--workdir", default=os.path.join(HERE, "out", "algos"))
  args = ap.parse_args()
  os.environ.setdefault("JAXRL_HEX_QUIET", "1")
  from jaxrl_hex.meshes import prepare_cpu_devices
  prepare_cpu_devices(8)
  from jaxrl_hex import commands
  from jaxrl_hex.config import load_config_file

  def config(name, **overrides):
    cfg = load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
    cfg.mesh_file = os.path.join(ROOT, "meshes", "cpu-8.yaml")
    for key, value in overrides.items():
      section, field = key.split(".")
      cfg[section][field] = value
    return cfg

  warm = os.path.join(args.workdir, "warm")
  if not os.path.isdir(os.path.join(warm, "checkpoints")):
    commands.sft(config("arith_grpo"), warm)
  results = {}
  for name in args.presets.split(","):
    workdir = os.path.join(args.workdir, f"{name}-{int(time.time())}")
    cfg = config(name, **{
        "train.steps": args.steps,
        "train.eval_every": args.steps,
        "train.checkpoint_every": args.steps
    })
    cfg.init_from = warm
    t0 = time.time()
    summary = commands.train(cfg, workdir)
    results[name] = {
        "eval_accuracy_start": summary["eval_accuracy_start"],
        "eval_accuracy_end": summary["eval_accuracy_end"],
        "seconds": time.time() - t0,
        "steps": args.steps
    }
    r = results[name]
    print(
        f"{name:13s} {r['eval_accuracy_start']:.3f} -> {r['eval_accuracy_end']:.3f} "
        f"({r['eval_accuracy_end'] - r['eval_accuracy_start']:+.3f}) in {r['seconds']:.0f}s", flush=True)
  os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
  with open(os.path.join(HERE, "out", "algos.json"), "w") as f:
    json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
