"""Writes the README's agentic table from real runs of the built-in agentic recipes, so the figures
it quotes are runs', not a memory of them:

  jaxrl-hex train --config=configs/calculator_grpo.py --workdir=runs/calc     # a tool task
  jaxrl-hex train --config=configs/guess_grpo.py --workdir=runs/guess         # a multi-turn environment
  jaxrl-hex train --config=configs/calculator_grpo.py --config.task=examples/react_calculator.py:make_agent \\
      --workdir=runs/react                                                   # an agent on the endpoint
  jaxrl-hex train --config=configs/calculator_grpo.py --config.cluster.backend=ray \\
      --config.mesh_file=meshes/cpu-ray.yaml --config.sync.method=direct --workdir=runs/calc_ray
  python docs/gen_agentic.py --calculator-workdir=runs/calc --guess-workdir=runs/guess \\
      --agent-workdir=runs/react --ray-workdir=runs/calc_ray [--note="quiet machine"]

The figures go to docs/agentic_summary.json (committed) and the table between the markers in
README.md is rendered from that file; tests/test_docs.py checks the two agree.
"""
import argparse
import datetime
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
SUMMARY = os.path.join(ROOT, "docs", "agentic_summary.json")
BEGIN = "<!-- agentic table: written by `python docs/gen_agentic.py` from docs/agentic_summary.json -->"
END = "<!-- end of agentic table -->"
RECIPES = (("calculator", "tool task: 3-digit products with a calculator (`configs/calculator_grpo.py`)"),
           ("guess", "environment: find 1-31 from higher/lower answers (`configs/guess_grpo.py`)"),
           ("agent", "an `openai`-client ReAct agent on the endpoint (`examples/react_calculator.py`)"),
           ("ray", "the tool task on the Ray backend"))


def _gen_demo():
  spec = importlib.util.spec_from_file_location("gen_demo", os.path.join(ROOT, "docs", "gen_demo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def figures(workdir: str) -> dict:
  """gen_demo's figures of a run, and its episodes' mean turns (metrics.jsonl)."""
  out = _gen_demo().figures(workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    turns = [r["episode_turns"] for r in map(json.loads, filter(str.strip, f)) if "episode_turns" in r]
  out["episode_turns"] = round(sum(turns) / len(turns), 2)
  return out


def render(summary: dict) -> str:
  duration = _gen_demo()._duration
  rows = []
  for key, what in RECIPES:
    d = summary.get(key)
    if d is None:
      continue
    gain = round(100 * (d["accuracy_end"] - d["accuracy_warmstart"]))
    rows.append(f"| {what} | {d['accuracy_warmstart']:.3f} ({d['warmstart_steps']} SFT steps) | "
                f"{d['accuracy_end']:.3f} ({gain:+d} points, {d['rl_steps']} RL steps) | {d['episode_turns']:.2f} | "
                f"{duration(d['rl_seconds'])} | {duration(d['wall_seconds'])} |")
  head = [
      f"{summary['date']}, jaxrl_hex {summary['version']}, {summary['machine']}", "",
      "| recipe | held-out success after the warm start | after RL | model turns per episode | RL phase | "
      "whole command |", "|---|---|---|---|---|---|"
  ]
  return "\n".join([BEGIN, ""] + head + rows + ["", END])


def rewrite(text: str, summary: dict) -> str:
  return _gen_demo().replace_block(text, BEGIN, END, render(summary))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--calculator-workdir", required=True, help="a finished run of configs/calculator_grpo.py")
  ap.add_argument("--guess-workdir", required=True, help="a finished run of configs/guess_grpo.py")
  ap.add_argument("--agent-workdir", help="a finished run of examples/react_calculator.py:make_agent")
  ap.add_argument("--ray-workdir", help="a finished run of configs/calculator_grpo.py on the Ray backend")
  ap.add_argument("--note", default="2 CPU cores", help="the machine and its load, as the table's header says it")
  args = ap.parse_args(argv)
  import sys
  sys.path.insert(0, ROOT)
  from jaxrl_hex import __version__
  summary = dict(date=datetime.date.today().isoformat(), version=__version__, machine=args.note,
                 calculator=figures(args.calculator_workdir), guess=figures(args.guess_workdir))
  for key, workdir in (("agent", args.agent_workdir), ("ray", args.ray_workdir)):
    if workdir:
      summary[key] = figures(workdir)
  _gen_demo().save(summary, SUMMARY, rewrite)


if __name__ == "__main__":
  main()
