"""Chaos on the Ray backend: rollout replicas killed at random while a run trains, one train
process killed mid-run and the run resumed, against an undisturbed run of the same config.

Reports steps completed, prompts lost and duplicated (each trained batch's prompts against what
an undisturbed prompt stream hands out, in order: both must be 0) and the wall-time overhead.
Kills: a random rollout process (from WORKDIR/cluster.json) every ~--kill-every seconds
(exponential gaps), and once, halfway, a train process (the run stops with exit 3; --resume
continues it from its last checkpoint).

  python benchmarks/chaos.py --steps 300     # the issue's run: ~30 min on 2 cores
  python benchmarks/chaos.py --steps 40 --kill-every 8    # a short one: ~6 min
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MESH = os.path.join(ROOT, "meshes", "cpu-ray.yaml")
SMALL = {"rollout.prompts_per_step": 8, "rollout.group_size": 4, "train.eval_size": 64, "sft.eval_size": 64}


def flags(overrides: dict) -> list:
  return [f"--config.{k}={v}" for k, v in overrides.items()]


def cli(*args) -> list:
  return [sys.executable, "-m", "jaxrl_hex.cli", *args]


def train_command(workdir, warm, steps) -> list:
  return cli("train", f"--workdir={workdir}", f"--config.init_from={warm}", f"--config.mesh_file={MESH}",
             "--config.cluster.backend=ray", "--config.sync.method=direct", f"--config.train.steps={steps}",
             "--config.train.eval_every=1000", "--config.train.checkpoint_every=5", *flags(SMALL))


def trained(workdir) -> list:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:  # a line being written
        continue
      if row.get("phase") == "train" and "prompt_ids" in row:
        rows.append(row)
  return rows


def run(cmd, env, on_tick=None) -> tuple[int, float]:
  """(exit status, seconds) of cmd, calling on_tick(proc) every 0.2 s while it runs."""
  t0 = time.time()
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  while proc.poll() is None:
    if on_tick is not None:
      on_tick(proc)
    time.sleep(0.2)
  err = proc.stderr.read()
  if proc.returncode not in (0, 3):
    raise SystemExit(f"{' '.join(cmd[:4])} exited {proc.returncode}: {err[-2000:]}")
  return proc.returncode, time.time() - t0


def audit(workdir, steps) -> dict:
  """Each trained batch's prompts against an undisturbed stream's, in order."""
  from jaxrl_hex.commands import DEFAULT_CONFIG
  from jaxrl_hex.config import apply_overrides, load_config_file
  from jaxrl_hex.data.prompts import PromptStream
  from jaxrl_hex.runtime import build_runtime
  cfg = load_config_file(DEFAULT_CONFIG)  # the config the runs' command line starts from
  apply_overrides(cfg, [(k, str(v)) for k, v in SMALL.items()])
  stream = PromptStream(build_runtime(cfg).task.train, SMALL["rollout.prompts_per_step"], seed=0)
  want = [i for _ in range(steps) for i in sorted(rec["index"] for rec in stream.next()[0])]
  got = [i for r in sorted(trained(workdir), key=lambda r: r["step"]) for i in r["prompt_ids"]]
  return dict(steps=len(trained(workdir)), prompts_lost=len(set(want) - set(got)),
              prompts_duplicated=len(got) - len(set(got)), prompts_in_order=got == want)


def main():
  from readme_section import write_section  # benchmarks/ is on the path when run as a script
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--kill-every", type=float, default=30.0, help="mean seconds between rollout kills")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", default=os.path.join(HERE, "out", "chaos.json"))
  args = ap.parse_args()
  env = dict(os.environ, JAXRL_HEX_QUIET="1")
  rng = random.Random(args.seed)
  with tempfile.TemporaryDirectory() as tmp:
    warm = os.path.join(tmp, "warm")
    run(
        cli("sft", f"--workdir={warm}", "--config.sft.max_steps=240", "--config.sft.target_accuracy=0.2",
            *flags(SMALL)), env)
    calm = os.path.join(tmp, "calm")
    _, calm_s = run(train_command(calm, warm, args.steps), env)

    chaos, kills = os.path.join(tmp, "chaos"), {"rollout": 0, "train": 0}
    next_kill = [time.time() + rng.expovariate(1 / args.kill_every)]

    def strike(proc):
      done = len(trained(chaos))
      try:
        processes = json.load(open(os.path.join(chaos, "cluster.json")))
      except (OSError, json.JSONDecodeError):
        return
      ckpts = os.path.join(chaos, "checkpoints")
      saved = os.listdir(ckpts) if os.path.isdir(ckpts) else []
      if not kills["train"] and done >= args.steps // 2 and any(name.isdigit() for name in saved):
        os.kill(processes["train"]["processes"][-1]["pid"], signal.SIGKILL)
        kills["train"] += 1
      elif time.time() >= next_kill[0]:
        live = [p["pid"] for p in processes["rollout"]["processes"] if "pid" in p]
        if live:
          try:
            os.kill(rng.choice(live), signal.SIGKILL)
            kills["rollout"] += 1
          except ProcessLookupError:
            pass
        next_kill[0] = time.time() + rng.expovariate(1 / args.kill_every)

    code, chaos_s = run(train_command(chaos, warm, args.steps), env, strike)
    resumed_s = 0.0
    while code == 3:  # the train process kill stopped it: resume, with the rollout kills going on
      code, seconds = run(train_command(chaos, warm, args.steps) + ["--resume"], env, strike)
      resumed_s += seconds
    result = dict(audit(chaos, args.steps), rollout_kills=kills["rollout"], train_kills=kills["train"],
                  undisturbed_s=calm_s, chaos_s=chaos_s + resumed_s, kill_every_s=args.kill_every,
                  restarts=json.load(open(os.path.join(chaos, "summary.json"))).get("rollout_restarts"))
  result["overhead"] = result["chaos_s"] / result["undisturbed_s"] - 1
  text = "\n".join([
      f"`python benchmarks/chaos.py --steps {args.steps} --kill-every {args.kill_every:g}`: the Ray backend on "
      "meshes/cpu-ray.yaml, rollout processes killed at random (exponential gaps), one train process killed "
      "halfway and the run resumed.", "",
      "| steps | rollout kills | train kills | prompts lost | prompts duplicated | in order | undisturbed s | "
      "chaos s | overhead |", "|---|---|---|---|---|---|---|---|---|",
      f"| {result['steps']} | {result['rollout_kills']} | {result['train_kills']} | {result['prompts_lost']} | "
      f"{result['prompts_duplicated']} | {'yes' if result['prompts_in_order'] else 'NO'} | "
      f"{result['undisturbed_s']:.0f} | {result['chaos_s']:.0f} | {result['overhead']:+.0%} |"
  ])
  print(text)
  write_section("chaos", text, "Chaos on the Ray backend (benchmarks/chaos.py, issue 16)")
  os.makedirs(os.path.dirname(args.json), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
