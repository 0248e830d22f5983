"""Writes the README's demo table from a real run of the README's main command, so the figures it
quotes are a run's, not a memory of one:

  jaxrl-hex train --workdir=runs/demo                  # the README's main command (embedded default)
  jaxrl-hex train --config=configs/arith_grpo_lora.py --workdir=runs/demo_lora   # the same with LoRA
  python docs/gen_demo.py --workdir=runs/demo --lora-workdir=runs/demo_lora [--note="quiet machine"]

The run's figures go to docs/demo_summary.json (committed), and the table between the markers in
README.md is rendered from that file; tests/test_docs.py checks the two agree, and a slow test
reruns the command and checks that the run reproduces them.
"""
import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
SUMMARY = os.path.join(ROOT, "docs", "demo_summary.json")
BEGIN = "<!-- demo table: written by `python docs/gen_demo.py --workdir=RUN` from docs/demo_summary.json -->"
END = "<!-- end of demo table -->"
LORA_BEGIN = ("<!-- LoRA demo table: written by `python docs/gen_demo.py --lora-workdir=RUN` from "
              "docs/demo_summary.json -->")
LORA_END = "<!-- end of LoRA demo table -->"


def figures(workdir: str) -> dict:
  """A finished train run's headline figures: its summary.json, and staleness from metrics.jsonl."""
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, filter(str.strip, f)) if r.get("phase") == "train" and "staleness_mean" in r]
  if not summary.get("warmstart") or not rows:
    raise SystemExit(f"{workdir}: not a finished run of the demo (it needs the warm start and RL steps)")
  rl_seconds = [r["wall_s"] for r in rows]
  return {
      "rl_seconds": round(rl_seconds[-1] - rl_seconds[0]),
      "warmstart_steps": summary["warmstart"]["steps"],
      "accuracy_warmstart": round(summary["warmstart"]["eval_accuracy_end"], 3),
      "rl_steps": summary["steps"],
      "accuracy_end": round(summary["eval_accuracy_end"], 3),
      "wall_seconds": round(summary["wall_seconds"]),
      "staleness_mean": round(sum(r["staleness_mean"] for r in rows) / len(rows), 2),
      "staleness_max": max(r["staleness_max"] for r in rows),
  }


def _duration(seconds: int) -> str:
  m, s = divmod(int(seconds), 60)
  return f"{m} min {s} s" if m else f"{s} s"


def render(demo: dict) -> str:
  """The README's table (markers included) for docs/demo_summary.json's contents."""
  gain = round(100 * (demo["accuracy_end"] - demo["accuracy_warmstart"]))
  rows = [
      (f"held-out greedy accuracy after the warm start ({demo['warmstart_steps']} SFT steps)",
       f"{demo['accuracy_warmstart']:.3f}"),
      (f"held-out greedy accuracy after {demo['rl_steps']} RL steps", f"{demo['accuracy_end']:.3f} ({gain:+d} points)"),
      ("wall time, whole command (compile, warm start, RL, evals)", _duration(demo["wall_seconds"])),
      ("staleness: mean / max over the run (η = 2)", f"{demo['staleness_mean']:.2f} / {demo['staleness_max']}"),
  ]
  head = f"| | {demo['date']}, jaxrl_hex {demo['version']}, {demo['machine']} |"
  return "\n".join([BEGIN, "", head, "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + ["", END])


def render_lora(demo: dict) -> str:
  """The README's LoRA table: the same warm start, then RL with full weights or rank-r adapters."""
  full, lora = demo, demo["lora"]
  gain = lambda d: f"{d['accuracy_end']:.3f} ({round(100 * (d['accuracy_end'] - d['accuracy_warmstart'])):+d} points)"
  rows = [
      ("held-out accuracy after the warm start", f"{full['accuracy_warmstart']:.3f}",
       f"{lora['accuracy_warmstart']:.3f}"),
      (f"after {full['rl_steps']} RL steps", gain(full), gain(lora)),
      ("RL phase wall time (first to last RL step)", _duration(full["rl_seconds"]), _duration(lora["rl_seconds"])),
      ("trained parameters", f"{full['trained_params']:,}", f"{lora['trained_params']:,} (rank {lora['lora_rank']})"),
  ]
  head = (f"| {demo['date']}, {demo['machine']} | full weights (`jaxrl-hex train`) | "
          "LoRA (`configs/arith_grpo_lora.py`) |")
  return "\n".join([LORA_BEGIN, "", head, "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows] +
                   ["", LORA_END])


def replace_block(text: str, begin: str, end: str, table: str) -> str:
  """README text with the block from `begin` to `end` (markers included) replaced by `table`."""
  head, found, rest = text.partition(begin)
  if not found or end not in rest:
    raise SystemExit(f"{README} has no `{begin}` ... `{end}` block to rewrite")
  return head + table + rest.split(end, 1)[1]


def rewrite(text: str, demo: dict) -> str:
  for begin, end, table in ((BEGIN, END, render(demo)), (LORA_BEGIN, LORA_END, render_lora(demo))):
    text = replace_block(text, begin, end, table)
  return text


def save(summary: dict, path: str, rewrite_readme):
  """summary as JSON at `path` (committed), and README.md rewritten by rewrite_readme(text, summary)."""
  with open(path, "w") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
  with open(README) as f:
    text = rewrite_readme(f.read(), summary)
  with open(README, "w") as f:
    f.write(text)
  print(f"wrote {path} and the table in {README}")


def trained_params(workdir: str) -> tuple:
  """(parameters the run trained, its LoRA rank) from its config.json."""
  import jax

  from jaxrl_hex.config import read_run_config
  from jaxrl_hex.models.config import model_config
  from jaxrl_hex.models.policy import Policy
  policy = Policy.build(model_config(**read_run_config(workdir).model))
  return sum(s.size for s in jax.tree.leaves(policy.split(policy.shapes())[0])), policy.cfg.lora.rank


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workdir", required=True, help="a finished `jaxrl-hex train` run of the README's main command")
  ap.add_argument("--lora-workdir", required=True, help="a finished run of configs/arith_grpo_lora.py, same machine")
  ap.add_argument("--note", default="2 CPU cores", help="the machine and its load, as the table's header says it")
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  from jaxrl_hex import __version__
  demo = dict(figures(args.workdir), date=datetime.date.today().isoformat(), version=__version__, machine=args.note)
  demo["trained_params"] = trained_params(args.workdir)[0]
  demo["lora"] = figures(args.lora_workdir)
  demo["lora"]["trained_params"], demo["lora"]["lora_rank"] = trained_params(args.lora_workdir)
  save(demo, SUMMARY, rewrite)


if __name__ == "__main__":
  main()
