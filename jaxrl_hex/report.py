"""`jaxrl-hex report WORKDIR [WORKDIR...]`: PNG figures and a markdown summary of runs.

Reads what every run writes (metrics.jsonl, spans.jsonl, config.json), so it works on finished
runs, runs still going, and resumed runs alike. Several workdirs share each figure, one colour
per run, so runs compare at a glance.
"""
import dataclasses
import json
import os
import time
import typing

import numpy as np
import yaml

from jaxrl_hex import arguments
from jaxrl_hex.config import read_run_config, resolve_path
from jaxrl_hex.errors import UserError
from jaxrl_hex.metrics import covered_seconds, read_jsonl

# figure file -> caption; the markdown lists them in this order
FIGURES = {
    "reward.png": "Mean reward of the training samples against RL step and against wall time.",
    "eval_accuracy.png": "Held-out greedy accuracy against RL step and against wall time.",
    "staleness.png": "Staleness of the trained samples: trainer version minus the oldest version in each sample.",
    "timeline.png": "What each pool was doing: rollout (generate, reward, weight sync) and train (step, publish).",
    "throughput.png": "Tokens per second on each pool, and weight-sync time per step.",
}
ZOOM = 10  # train steps in the timeline's close-up
KIND_COLORS = {"generate": "tab:green", "reward": "tab:olive", "step": "tab:blue", "sync": "tab:red"}


@dataclasses.dataclass
class Run:
  label: str
  workdir: str
  rows: list  # the RL phase (or the last phase, for an sft-only run), one row per step
  spans: list
  config: typing.Any  # the run's ConfigDict, None if it saved none
  phases: dict  # phase -> its rows, for the summary

  def series(self, key):
    """(steps, rl seconds, values) of the rows that carry `key`."""
    picked = [r for r in self.rows if r.get(key) is not None]
    return (np.array([r["step"] for r in picked]), np.array([r["rl_s"] for r in picked]),
            np.array([r[key] for r in picked], dtype=float))


def load_run(workdir: str, label: str) -> Run:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise UserError(f"report: {workdir} has no metrics.jsonl; pass the workdir of a train or sft run")
  phases = {}
  for row in _monotonic_wall(read_jsonl(path)):
    phases.setdefault(row.get("phase", "run"), {})[row["step"]] = row  # a resumed step: the rerun wins
  phases = {p: [rows[s] for s in sorted(rows)] for p, rows in phases.items()}
  if not phases:
    raise UserError(f"report: {path} is empty; the run logged no step yet")
  rows = phases.get("train") or list(phases.values())[-1]
  for r in rows:
    r["rl_s"] = r["wall_s"] - rows[0]["wall_s"]
  spans_path = os.path.join(workdir, "spans.jsonl")
  spans = read_jsonl(spans_path) if os.path.exists(spans_path) else []
  config = read_run_config(workdir) if os.path.exists(os.path.join(workdir, "config.json")) else None
  return Run(label, workdir, rows, spans, config, phases)


def _monotonic_wall(rows):
  """wall_s restarts at 0 when a run resumes; add the time before each restart."""
  offset, last = 0.0, 0.0
  for row in rows:
    wall = row.get("wall_s", last - offset) + offset
    if wall < last:
      offset, wall = offset + last - wall, last
    row["wall_s"] = last = wall
  return rows


def _labels(workdirs):
  names = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  return names if len(set(names)) == len(names) else [os.path.normpath(w) for w in workdirs]


# ---- figures ------------------------------------------------------------------------------------
def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _colors(runs):
  return {r.label: f"C{i % 10}" for i, r in enumerate(runs)}


def _no_data(ax, what):
  ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def _curve_figure(runs, key, ylabel, path):
  """`key` against step (left) and wall time (right), one line per run."""
  plt = _plt()
  colors = _colors(runs)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  drawn = False
  for run in runs:
    steps, seconds, values = run.series(key)
    if len(values):
      drawn = True
      style = dict(color=colors[run.label], marker="o" if len(values) < 30 else None, ms=3, lw=1.4)
      axes[0].plot(steps, values, label=run.label, **style)
      axes[1].plot(seconds, values, label=run.label, **style)
  for ax, xlabel in zip(axes, ("RL step", "seconds since RL start")):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if not drawn:
      _no_data(ax, key)
  if drawn:
    axes[0].legend(fontsize=8)
  fig.suptitle(ylabel)
  _save(fig, path)


def _staleness_figure(runs, path):
  plt = _plt()
  colors = _colors(runs)
  fig, ax = plt.subplots(figsize=(7, 4))
  hists = [_staleness_counts(run) for run in runs]
  values = sorted({v for h in hists for v in h})
  width = 0.8 / max(len(runs), 1)
  for i, (run, hist) in enumerate(zip(runs, hists)):
    total = sum(hist.values())
    if total:
      eta = (run.config.train.max_staleness if run.config else None)
      ax.bar([v + (i - (len(runs) - 1) / 2) * width for v in values], [hist.get(v, 0) / total for v in values], width,
             color=colors[run.label], label=run.label + ("" if eta is None else f" (η={eta})"))
  if values:
    ax.set_xticks(values)
    ax.legend(fontsize=8)
  else:
    _no_data(ax, "staleness_hist")
  ax.set_xlabel("staleness (policy versions behind the trainer)")
  ax.set_ylabel("share of trained samples")
  ax.grid(alpha=0.3, axis="y")
  fig.suptitle("Staleness")
  _save(fig, path)


def _staleness_counts(run) -> dict:
  counts = {}
  for r in run.rows:
    for v, c in (r.get("staleness_hist") or {}).items():
      counts[int(v)] = counts.get(int(v), 0) + c
  return counts


def _timeline_figure(runs, path):
  """Per run: the whole run (left; the first spans include compilation) and its last ZOOM train steps."""
  plt = _plt()
  fig, axes = plt.subplots(len(runs), 2, figsize=(14, 2.2 + 1.6 * len(runs)), squeeze=False, width_ratios=[3, 2])
  for (whole, zoom), run in zip(axes, runs):
    t0 = min((s["start"] for s in run.spans), default=0.0)
    steps = sorted(s["start"] for s in run.spans if s["kind"] == "step")
    since = steps[-min(ZOOM, len(steps))] - t0 if steps else 0.0
    for ax, title in ((whole, run.label), (zoom, f"{run.label}: last {min(ZOOM, len(steps))} train steps")):
      _draw_spans(ax, run.spans, t0)
      ax.set_title(title, fontsize=9, loc="left")
      ax.set_xlabel("seconds since the first span")
    if steps:
      zoom.set_xlim(since, max(s["end"] for s in run.spans) - t0)
  kinds = sorted({s["kind"] for run in runs for s in run.spans})
  if kinds:
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS.get(k, "tab:gray")) for k in kinds]
    fig.legend(handles, kinds, loc="upper right", fontsize=8, ncol=len(kinds))
  fig.suptitle("Timeline per pool")
  _save(fig, path)


def _draw_spans(ax, spans, t0):
  pools = sorted({s["pool"] for s in spans}, reverse=True)  # train above rollout
  if not pools:
    _no_data(ax, "spans")
  for y, pool in enumerate(pools):
    by_kind = {}
    for s in spans:
      if s["pool"] == pool:
        by_kind.setdefault(s["kind"], []).append((s["start"] - t0, max(s["end"] - s["start"], 1e-4)))
    for kind, bars in by_kind.items():
      ax.broken_barh(bars, (y + 0.1, 0.8), color=KIND_COLORS.get(kind, "tab:gray"))
  ax.set_yticks([y + 0.5 for y in range(len(pools))])
  ax.set_yticklabels(pools)
  ax.set_ylim(0, max(len(pools), 1))


def _throughput_figure(runs, path):
  plt = _plt()
  colors = _colors(runs)
  fig, (tok, sync) = plt.subplots(1, 2, figsize=(11, 4))
  for run in runs:
    for key, style, pool in (("rollout_tokens_per_s", "-", "rollout"), ("train_tokens_per_s", "--", "train")):
      steps, _, values = run.series(key)
      if len(values):
        tok.plot(steps, values, style, color=colors[run.label], lw=1.2, label=f"{run.label} {pool}")
    steps, _, values = run.series("sync_seconds")
    if len(values):
      sync.plot(steps, values * 1e3, color=colors[run.label], lw=1.2, label=run.label)
  for ax, ylabel, what in ((tok, "tokens/s (solid: rollout pool, dashed: train pool)", "tokens/s"),
                           (sync, "weight sync per step (ms)", "sync_seconds")):
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=7)
    else:
      _no_data(ax, what)
  fig.suptitle("Throughput per pool and weight sync")
  _save(fig, path)


def _save(fig, path):
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  _plt().close(fig)


# ---- summary ------------------------------------------------------------------------------------
def summarize(run: Run) -> dict:
  """The headline numbers of one run (None where the run did not log them)."""

  def stat(key, fn):
    values = run.series(key)[2]
    return float(fn(values)) if len(values) else None

  hist = _staleness_counts(run)
  n = sum(hist.values())
  window = (min((s["start"] for s in run.spans), default=0.0), max((s["end"] for s in run.spans), default=0.0))
  busy = {}
  for s in run.spans:
    busy[s["pool"]] = busy.get(s["pool"], 0.0) + s["end"] - s["start"]
  accs = run.series("eval_accuracy")[2]
  warm = next((rows for phase, rows in run.phases.items() if phase != "train"), []) if "train" in run.phases else []
  warm_acc = [r["eval_accuracy"] for r in warm if r.get("eval_accuracy") is not None]
  return {
      "steps": int(run.rows[-1]["step"]),
      "warm_start_steps": int(warm[-1]["step"]) if warm else None,
      "warm_start_accuracy": warm_acc[-1] if warm_acc else None,
      "eval_accuracy_start": float(accs[0]) if len(accs) else None,
      "eval_accuracy_end": float(accs[-1]) if len(accs) else None,
      "eval_accuracy_best": float(accs.max()) if len(accs) else None,
      "reward_first10": stat("reward_mean", lambda v: v[:10].mean()),
      "reward_last10": stat("reward_mean", lambda v: v[-10:].mean()),
      "staleness_mean": sum(v * c for v, c in hist.items()) / n if n else None,
      "staleness_max": max(hist) if hist else None,
      "max_staleness": (run.config.train.max_staleness if run.config else None),
      "rollout_tokens_per_s": stat("rollout_tokens_per_s", np.median),
      "train_tokens_per_s": stat("train_tokens_per_s", np.median),
      "sync_ms": stat("sync_seconds", lambda v: 1e3 * np.median(v)),
      "rl_seconds": float(run.rows[-1]["rl_s"]),
      "busy": {
          pool: t / (window[1] - window[0]) for pool, t in sorted(busy.items()) if window[1] > window[0]
      },
      "plan": plan_vs_measured(run),
  }


def _median(values):
  return float(np.median(values)) if len(values) else None


def plan_vs_measured(run: Run) -> dict | None:
  """The planner's predictions for the run's mesh file (its `plan:` block, as `jaxrl-hex plan`
  writes it) beside what the run measured, in the same units: {figure: (predicted, measured)}.
  None when the mesh file holds no plan.
    step_s            median seconds between train steps
    train_step_s      median train step (its `step` spans)
    rollout_s         median generation of a batch (its `generate` spans)
    gen_tokens_per_s  tokens generated over the seconds some batch was generating
    share[g]          a replica's fraction of the prompts, per replica group (Ray fleets)"""
  mesh_file = run.config.get("mesh_file") if run.config is not None else None
  path = resolve_path(mesh_file) if mesh_file else None
  if not path or not os.path.exists(path):
    return None
  with open(path) as f:
    raw = yaml.safe_load(f) or {}
  predicted = (raw.get("plan") or {}).get("predicted")
  if not predicted:
    return None
  walls = [r["wall_s"] for r in run.rows if r.get("batch") is not None]
  steps = [s["end"] - s["start"] for s in run.spans if (s["pool"], s["kind"]) == ("train", "step")]
  gens = {s["batch"]: s for s in run.spans if (s["pool"], s["kind"]) == ("rollout", "generate")}
  tokens = sum(r["rollout_tokens_per_s"] * (gens[r["batch"]]["end"] - gens[r["batch"]]["start"]) for r in run.rows
               if r.get("batch") in gens and r.get("rollout_tokens_per_s") is not None)
  spans = [(s["start"], s["end"]) for s in gens.values()]
  generating = covered_seconds(spans, min((a for a, _ in spans), default=0.0), max((b for _, b in spans), default=0.0))
  measured = {
      "step_s": _median(np.diff(walls)),
      "train_step_s": _median(steps),
      "rollout_s": _median([s["end"] - s["start"] for s in gens.values()]),
      "gen_tokens_per_s": tokens / generating if generating else None,
  }
  out = {k: (predicted.get(k), v) for k, v in measured.items()}
  groups = (raw.get("pools", {}).get("rollout") or {}).get("replicas") or []
  prompts = {}
  for s in run.spans:
    if (s["pool"], s["kind"]) == ("rollout", "route"):
      for r in s["replicas"]:
        prompts[r["group"]] = prompts.get(r["group"], 0) + r["prompts"]
  total = sum(prompts.values())
  for gi, g in enumerate(groups):
    out[f"share[{gi}]"] = (g.get("share"), prompts.get(gi, 0) / total / g["count"] if total else None)
  return out


def _fmt(value, spec="{:.3f}"):
  return "–" if value is None else spec.format(value)


def markdown(runs, summaries, figures, command) -> str:
  lines = [
      "# Run report", "", f"`{command}`", "",
      "| run | RL steps | eval accuracy start → end (best) | reward first → last 10 steps | "
      "staleness mean / max (η) | rollout tok/s | train tok/s | sync ms | RL seconds | pools busy |",
      "|---|---|---|---|---|---|---|---|---|---|"
  ]
  for run, s in zip(runs, summaries):
    busy = ", ".join(f"{pool} {share:.0%}" for pool, share in s["busy"].items()) or "–"
    lines.append(f"| {run.label} | {s['steps']} | {_fmt(s['eval_accuracy_start'])} → {_fmt(s['eval_accuracy_end'])} "
                 f"({_fmt(s['eval_accuracy_best'])}) | {_fmt(s['reward_first10'])} → {_fmt(s['reward_last10'])} | "
                 f"{_fmt(s['staleness_mean'], '{:.2f}')} / {_fmt(s['staleness_max'], '{}')} "
                 f"({_fmt(s['max_staleness'], '{}')}) | "
                 f"{_fmt(s['rollout_tokens_per_s'], '{:,.0f}')} | {_fmt(s['train_tokens_per_s'], '{:,.0f}')} | "
                 f"{_fmt(s['sync_ms'], '{:.1f}')} | {_fmt(s['rl_seconds'], '{:.0f}')} | {busy} |")
  lines.append("")
  for run, s in zip(runs, summaries):
    if s["warm_start_steps"] is not None:
      lines.append(f"- {run.label}: warm start of {s['warm_start_steps']} supervised steps reached "
                   f"eval accuracy {_fmt(s['warm_start_accuracy'])} before RL.")
  lines += [
      "", "Tokens/s and sync are medians over the logged steps; *pools busy* is the share of the "
      "run's span window each pool spent in recorded work.", ""
  ]
  for run, s in zip(runs, summaries):
    if s.get("plan") is not None:
      lines += [
          f"## Plan vs measured: {run.label}", "", "| figure | planner | measured | measured / planner |",
          "|---|---|---|---|"
      ]
      for name, (want, got) in s["plan"].items():
        ratio = got / want if want and got is not None else None
        lines.append(f"| {name} | {_fmt(want, '{:,.4g}')} | {_fmt(got, '{:,.4g}')} | {_fmt(ratio, '{:.2f}x')} |")
      lines += [
          "", "The planner's figures are the `plan: predicted:` block of the run's mesh file, "
          "as `jaxrl-hex plan` wrote it.", ""
      ]
  lines += ["## Figures", ""]
  for name in figures:
    title = name[:-len(".png")].replace("_", " ")
    lines += [f"### {title}", "", FIGURES[name], "", f"![{title}]({name})", ""]
  return "\n".join(lines)


def render(workdirs, out, command="jaxrl-hex report") -> dict:
  """Writes the figures and report.md into `out`; returns {"figures": [paths], "markdown": path}."""
  runs = [load_run(w, label) for w, label in zip(workdirs, _labels(workdirs))]
  os.makedirs(out, exist_ok=True)
  _curve_figure(runs, "reward_mean", "mean reward", os.path.join(out, "reward.png"))
  _curve_figure(runs, "eval_accuracy", "held-out accuracy", os.path.join(out, "eval_accuracy.png"))
  _staleness_figure(runs, os.path.join(out, "staleness.png"))
  _timeline_figure(runs, os.path.join(out, "timeline.png"))
  _throughput_figure(runs, os.path.join(out, "throughput.png"))
  summaries = [summarize(r) for r in runs]
  md = os.path.join(out, "report.md")
  with open(md, "w") as f:
    f.write(markdown(runs, summaries, list(FIGURES), command))
  with open(os.path.join(out, "report.json"), "w") as f:
    json.dump({r.label: s for r, s in zip(runs, summaries)}, f, indent=2)
  return {"figures": [os.path.join(out, name) for name in FIGURES], "markdown": md}


def _report(args, argv):
  out = args.out or (os.path.join(args.workdirs[0], "report") if len(args.workdirs) == 1 else os.path.join(
      "runs", f"report-{time.strftime('%Y%m%d-%H%M%S')}"))
  result = render(args.workdirs, out, "jaxrl-hex report " + " ".join(argv))
  print(f"report: {result['markdown']}")


def main(argv) -> int:
  ap = arguments.Parser("jaxrl-hex report", "Figures and a markdown summary of one run, or several compared.")
  ap.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="run directories (with metrics.jsonl)")
  ap.add_argument("--out", help="output folder (default: WORKDIR/report for one run, "
                  "runs/report-<time> for several)")
  return arguments.run(ap, lambda args: _report(args, argv), argv)
