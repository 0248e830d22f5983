"""Writes the README's demo table from a real run of the README's main command, so the figures it
quotes are a run's, not a memory of one:

  jaxrl-hex train --workdir=runs/demo                  # the README's main command (embedded default)
  python docs/gen_demo.py --workdir=runs/demo [--note="quiet machine"]   # docs/demo_summary.json + README

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


def figures(workdir: str) -> dict:
  """A finished train run's headline figures: its summary.json, and staleness from metrics.jsonl."""
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, filter(str.strip, f)) if r.get("phase") == "train" and "staleness_mean" in r]
  if not summary.get("warmstart") or not rows:
    raise SystemExit(f"{workdir}: not a finished run of the demo (it needs the warm start and RL steps)")
  return {
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


def rewrite(text: str, demo: dict) -> str:
  head, found, rest = text.partition(BEGIN)
  if not found or END not in rest:
    raise SystemExit(f"{README} has no `{BEGIN}` ... `{END}` block to rewrite")
  return head + render(demo) + rest.split(END, 1)[1]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workdir", required=True, help="a finished `jaxrl-hex train` run of the README's main command")
  ap.add_argument("--note", default="2 CPU cores", help="the machine and its load, as the table's header says it")
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  from jaxrl_hex import __version__
  demo = dict(figures(args.workdir), date=datetime.date.today().isoformat(), version=__version__, machine=args.note)
  with open(SUMMARY, "w") as f:
    json.dump(demo, f, indent=2)
    f.write("\n")
  with open(README) as f:
    text = rewrite(f.read(), demo)
  with open(README, "w") as f:
    f.write(text)
  print(f"wrote {SUMMARY} and the table in {README}")


if __name__ == "__main__":
  main()
