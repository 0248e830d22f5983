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

# figure file -> caption; the markdown lists them in this order. A figure is drawn when some run
# logged what it shows (an SFT run has no reward, staleness or spans). Wall time leaves out the
# downtime between a stop and its resume; a dashed line marks each resume and no curve crosses it.
FIGURES = {
    "reward.png": "Mean reward of the training samples against RL step and against wall time.",
    "sft_loss.png": "Supervised (teacher-forced) loss and token accuracy of the SFT runs against SFT step.",
    "eval_accuracy.png": "Held-out greedy accuracy against step and against wall time.",
    "staleness.png": "Staleness of the trained samples: trainer version minus the oldest version in each sample.",
    "timeline.png": "What each pool was doing: rollout (generate, reward, weight sync) and train (step, publish); "
                    "the whole run to scale (left) and the last train steps, short spans widened to be seen (right).",
    "throughput.png": "Tokens per second on each pool, and weight-sync time per RL step.",
    "episodes.png": "Episodes of an environment: model turns and tool calls per episode, the share of their "
                    "tokens that are observations (context, not trained), and their length in tokens "
                    "(mean, 90th percentile, longest).",
}
ZOOM = 10  # train steps in the timeline's close-up
ZOOM_MIN_WIDTH = 1 / 250  # of the close-up's window: a span narrower than this is widened to it there
KIND_COLORS = {
    "start": "tab:purple",  # a pool starting: its runtime, restore or warm start, compiles (Ray)
    "probe": "tab:orange",
    "generate": "tab:green",
    "reward": "tab:olive",
    "step": "tab:blue",
    "sync": "tab:red"
}


@dataclasses.dataclass
class Run:
  label: str
  workdir: str
  rows: list  # the RL phase (or the last phase, for an sft-only run), one row per step
  spans: list
  config: typing.Any  # the run's ConfigDict, None if it saved none
  phases: dict  # phase -> its rows, for the summary

  @property
  def kind(self) -> str:
    """"RL", or "SFT" for a run with no RL phase (its rows are supervised steps)."""
    return "RL" if "train" in self.phases else "SFT"

  @property
  def resumes(self) -> list:
    """(step, rl seconds) where each resume picked the run up: its checkpoint's step and row."""
    return [(row["resumed_from"], prev["rl_s"]) for prev, row in zip(self.rows, self.rows[1:])
            if row.get("resumed_from") is not None]

  def series(self, key, breaks=False):
    """(steps, rl seconds, values) of the rows that carry `key`; with `breaks`, a NaN point between
    the rows either side of each resume, so that a line drawn through them breaks there."""
    picked, resumed = [], False
    for r in self.rows:
      resumed = resumed or r.get("resumed_from") is not None
      if r.get(key) is not None:
        if breaks and resumed and picked:
          picked.append({"step": np.nan, "rl_s": np.nan, key: np.nan})
        picked.append(r)
        resumed = False
    return tuple(np.array([r[k] for r in picked], dtype=float) for k in ("step", "rl_s", key))


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
  """wall_s restarts at 0 in a resumed process: its rows count on from the row it resumed at, so
  the restart's own cost (restore, compile) shows and the downtime before it does not."""
  offset, last = 0.0, 0.0
  for row in rows:
    raw = row.get("wall_s", last - offset)
    if row.get("resumed_from") is not None or raw + offset < last:  # no marker: a file from before resumed_from
      offset = last
    row["wall_s"] = last = raw + offset
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


def _kind(runs) -> str:
  """What the step axis counts: "RL", "SFT", or "RL or SFT" in a report that compares both."""
  return " or ".join(sorted({r.kind for r in runs}, reverse=True))


def _name(run, kind) -> str:
  """A run's legend entry: its label, and its kind where the report mixes kinds."""
  return run.label if run.kind == kind else f"{run.label} ({run.kind})"


def _no_data(ax, what):
  ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def _plot(ax, run, key, color, name, wall=False, style="-", scale=1.0) -> bool:
  """One run's `key` against step (or seconds, `wall`), broken at each resume; False if it logged none."""
  steps, seconds, values = run.series(key, breaks=True)
  if not len(values):
    return False
  shown = ~np.isnan(values)
  # a segment of one point has no line to see; its neighbours' count (convolve's "same" mode would
  # return the kernel's length for a 2-point series)
  alone = shown & (np.convolve(shown, [1, 0, 1])[1:-1] == 0)
  few = shown.sum() < 30
  ax.plot(seconds if wall else steps, values * scale, style, color=color, label=name, lw=1.4,
          marker="o" if few or alone.any() else None, ms=3, markevery=None if few else list(alone))
  return True


def _mark_resumes(ax, run, color, wall=False):
  """A dashed line labelled "resumed" where each resume picked the run up."""
  for step, seconds in run.resumes:
    x = seconds if wall else step
    ax.axvline(x, color=color, ls="--", lw=1, alpha=0.8)
    ax.text(x, 0.98, "resumed", transform=ax.get_xaxis_transform(), rotation=90, ha="right", va="top", fontsize=7,
            color=color)


def _finish(ax, xlabel, ylabel, what):
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel, fontsize=8 if len(ylabel) > 30 else None)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  else:
    _no_data(ax, what)


def _curve_figure(runs, key, ylabel):
  """`key` against step (left) and wall time (right), one line per run."""
  colors, kind = _colors(runs), _kind(runs)
  fig, axes = _plt().subplots(1, 2, figsize=(11, 4))
  for run in runs:
    for ax, wall in zip(axes, (False, True)):
      if _plot(ax, run, key, colors[run.label], _name(run, kind), wall):
        _mark_resumes(ax, run, colors[run.label], wall)
  for ax, xlabel in zip(axes, (f"{kind} step", f"seconds since {kind} start")):
    _finish(ax, xlabel, ylabel, key)
  fig.suptitle(ylabel)
  return fig


def _sft_figure(runs):
  """Loss and token accuracy of the SFT runs against SFT step."""
  colors = _colors(runs)
  fig, axes = _plt().subplots(1, 2, figsize=(11, 4))
  ylabels = {
      "loss": "SFT loss (mean NLL of the answer tokens)",
      "token_accuracy": "token accuracy (answer tokens with p > 0.5)",
  }
  for ax, (key, ylabel) in zip(axes, ylabels.items()):
    for run in runs:
      if run.kind == "SFT" and _plot(ax, run, key, colors[run.label], run.label):
        _mark_resumes(ax, run, colors[run.label])
    _finish(ax, "SFT step", ylabel, key)
  fig.suptitle("Supervised fine-tuning")
  return fig


def _staleness_figure(runs):
  colors = _colors(runs)
  fig, ax = _plt().subplots(figsize=(7, 4))
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
  return fig


def _staleness_counts(run) -> dict:
  counts = {}
  for r in run.rows:
    for v, c in (r.get("staleness_hist") or {}).items():
      counts[int(v)] = counts.get(int(v), 0) + c
  return counts


def _timeline_figure(runs):
  """Per run with spans: the whole run to scale (left; the first spans include compilation) and its
  last ZOOM train steps, where spans too short to see are widened to ZOOM_MIN_WIDTH of the window."""
  plt = _plt()
  runs = [run for run in runs if run.spans]
  fig, axes = plt.subplots(len(runs), 2, figsize=(14, 2.2 + 1.6 * len(runs)), squeeze=False, width_ratios=[3, 2])
  for (whole, zoom), run in zip(axes, runs):
    t0 = min(s["start"] for s in run.spans)
    steps = sorted(s["start"] for s in run.spans if s["kind"] == "step")
    _draw_spans(whole, run.spans, t0)
    if steps:
      window = (steps[-min(ZOOM, len(steps))] - t0, max(s["end"] for s in run.spans) - t0)
      _draw_spans(zoom, run.spans, t0, min_width=(window[1] - window[0]) * ZOOM_MIN_WIDTH)
      zoom.set_xlim(*window)
    else:
      _draw_spans(zoom, run.spans, t0)
    whole.set_title(f"{run.label}: the whole run, to scale", fontsize=9, loc="left")
    zoom.set_title(f"{run.label}: last {min(ZOOM, len(steps))} train steps (short spans widened)", fontsize=9,
                   loc="left")
    for ax in (whole, zoom):
      ax.set_xlabel("seconds since the first span")
  kinds = sorted({s["kind"] for run in runs for s in run.spans})
  handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS.get(k, "tab:gray")) for k in kinds]
  fig.legend(handles, kinds, loc="upper right", fontsize=8, ncol=len(kinds))
  fig.suptitle("Timeline per pool", x=0.01, ha="left")  # the legend takes the right
  return fig


def _draw_spans(ax, spans, t0, min_width=0.0):
  """Each pool's spans as bars, one row per pool; kinds of long spans first, so short ones lie on top."""
  pools = sorted({s["pool"] for s in spans}, reverse=True)  # train above rollout
  bars = {}
  for s in spans:
    bars.setdefault((s["pool"], s["kind"]), []).append((s["start"] - t0, s["end"] - s["start"]))
  for (pool, kind), row in sorted(bars.items(), key=lambda item: -np.median([w for _, w in item[1]])):
    _bars(ax, np.array(row), pools.index(pool), max(min_width, 0.0), KIND_COLORS.get(kind, "tab:gray"),
          f"{pool} {kind}")
  ax.autoscale_view()  # patches, unlike plots, leave the view limits as they were
  ax.set_yticks([y + 0.5 for y in range(len(pools))])
  ax.set_yticklabels(pools)
  ax.set_ylim(0, max(len(pools), 1))


def _bars(ax, bars, y, min_width, color, label):
  """bars [N, 2] (start, width) as one compound path without edges: Agg sums the coverage of all N
  within a pixel, so thousands of sub-pixel bars blend in proportion to their time. (Separate
  bars, as broken_barh draws them, let the background show through the seams, and an edge line
  widens each bar by a pixel.)"""
  from matplotlib.patches import PathPatch
  from matplotlib.path import Path
  x, w = bars[:, 0], np.maximum(bars[:, 1], min_width)
  corners = np.stack([x, x + w, x + w, x, x], axis=1)  # [N, 5]: a closed rectangle per bar
  heights = np.broadcast_to([y + 0.1, y + 0.1, y + 0.9, y + 0.9, y + 0.1], corners.shape)
  path = Path.make_compound_path_from_polys(np.stack([corners, heights], axis=-1))
  ax.add_patch(PathPatch(path, facecolor=color, linewidth=0, snap=False, label=label))


def _throughput_figure(runs):
  """Tokens/s per pool against step, and (for RL runs) the weight sync per RL step."""
  colors, kind = _colors(runs), _kind(runs)
  rl = [run for run in runs if run.kind == "RL"]
  fig, axes = _plt().subplots(1, 2 if rl else 1, figsize=(11 if rl else 6.5, 4), squeeze=False)
  tok = axes[0][0]
  for run in runs:
    drawn = [
        _plot(tok, run, key, colors[run.label], f"{_name(run, kind)} {pool}", style=style)
        for key, style, pool in (("rollout_tokens_per_s", "-", "rollout"), ("train_tokens_per_s", "--", "train"))
    ]
    if any(drawn):
      _mark_resumes(tok, run, colors[run.label])
  _finish(tok, f"{kind} step", "tokens/s (solid: rollout pool, dashed: train pool)" if rl else "tokens/s", "tokens/s")
  if rl:
    sync = axes[0][1]
    for run in rl:
      if _plot(sync, run, "sync_seconds", colors[run.label], run.label, scale=1e3):
        _mark_resumes(sync, run, colors[run.label])
    _finish(sync, "RL step", "weight sync per step (ms)", "sync_seconds")
  fig.suptitle("Throughput per pool and weight sync" if rl else "Throughput of the train pool")
  return fig


def _episodes_figure(runs):
  """Per RL step: turns and tool calls per episode, the observations' token share, episode lengths."""
  colors, kind = _colors(runs), _kind(runs)
  fig, axes = _plt().subplots(1, 3, figsize=(15, 4))
  panels = ((axes[0], (("episode_turns", "-", "turns"), ("episode_tool_calls", "--", "tool calls")),
             "per episode (solid: turns, dashed: tool calls)"), (axes[1], (("env_token_share", "-", ""),),
                                                                 "observation share of episode tokens"),
            (axes[2], (("episode_tokens_mean", "-", "mean"), ("episode_tokens_p90", "--", "p90"),
                       ("episode_tokens_max", ":", "max")), "episode tokens (solid mean, dashed p90, dotted max)"))
  for ax, keys, ylabel in panels:
    for run in runs:
      drawn = [
          _plot(ax, run, key, colors[run.label], f"{_name(run, kind)} {what}".strip(), style=style)
          for key, style, what in keys
      ]
      if any(drawn):
        _mark_resumes(ax, run, colors[run.label])
    _finish(ax, f"{kind} step", ylabel, keys[0][0])
  fig.suptitle("Episodes")
  return fig


def figures(runs) -> dict:
  """{file name: matplotlib figure} of what the runs logged, in FIGURES' order (the caller closes them)."""
  rl, sft = any(r.kind == "RL" for r in runs), any(r.kind == "SFT" for r in runs)
  draw = {
      "reward.png": (rl, lambda: _curve_figure(runs, "reward_mean", "mean reward")),
      "sft_loss.png": (sft, lambda: _sft_figure(runs)),
      "eval_accuracy.png": (True, lambda: _curve_figure(runs, "eval_accuracy", "held-out accuracy")),
      "staleness.png": (rl, lambda: _staleness_figure(runs)),
      "timeline.png": (any(r.spans for r in runs), lambda: _timeline_figure(runs)),
      "throughput.png": (True, lambda: _throughput_figure(runs)),
      "episodes.png": (any(len(r.series("episode_turns")[2]) for r in runs), lambda: _episodes_figure(runs)),
  }
  return {name: draw[name][1]() for name in FIGURES if draw[name][0]}


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
      "max_staleness": (run.config.train.max_staleness if run.config and run.kind == "RL" else None),
      "rollout_tokens_per_s": stat("rollout_tokens_per_s", np.median),
      "train_tokens_per_s": stat("train_tokens_per_s", np.median),
      "sync_ms": stat("sync_seconds", lambda v: 1e3 * np.median(v)),
      "rl_seconds": float(run.rows[-1]["rl_s"]),
      "busy": {
          pool: t / (window[1] - window[0]) for pool, t in sorted(busy.items()) if window[1] > window[0]
      },
      "resumed_at": [step for step, _ in run.resumes],
      "episode_turns": stat("episode_turns", np.mean),
      "episode_tool_calls": stat("episode_tool_calls", np.mean),
      "env_token_share": stat("env_token_share", np.mean),
      "tool_errors": stat("tool_errors", np.max),
      "episode_faults": stat("episode_faults", np.max),
      "plan": plan_vs_measured(run),
  }


def _median(values):
  return float(np.median(values)) if len(values) else None


def plan_vs_measured(run: Run) -> dict | None:
  """The planner's predictions for the run's mesh file (its `plan:` block, as `jaxrl-hex plan`
  writes it) beside what the run measured, in the same units: {figure: (predicted, measured)}.
  None when the mesh file holds no plan.
    step_s            median seconds between train steps (of one process: none across a resume)
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
  gaps = np.diff(run.series("batch", breaks=True)[1])  # NaN across a resume: the restart is no step
  steps = [s["end"] - s["start"] for s in run.spans if (s["pool"], s["kind"]) == ("train", "step")]
  gens = {s["batch"]: s for s in run.spans if (s["pool"], s["kind"]) == ("rollout", "generate")}
  tokens = sum(r["rollout_tokens_per_s"] * (gens[r["batch"]]["end"] - gens[r["batch"]]["start"]) for r in run.rows
               if r.get("batch") in gens and r.get("rollout_tokens_per_s") is not None)
  spans = [(s["start"], s["end"]) for s in gens.values()]
  generating = covered_seconds(spans, min((a for a, _ in spans), default=0.0), max((b for _, b in spans), default=0.0))
  measured = {
      "step_s": _median(gaps[~np.isnan(gaps)]),
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
      "| run | steps | eval accuracy start → end (best) | reward first → last 10 steps | "
      "staleness mean / max (η) | rollout tok/s | train tok/s | sync ms | seconds | pools busy |",
      "|---|---|---|---|---|---|---|---|---|---|"
  ]
  for run, s in zip(runs, summaries):
    busy = ", ".join(f"{pool} {share:.0%}" for pool, share in s["busy"].items()) or "–"
    lines.append(f"| {run.label} | {s['steps']} {run.kind} | "
                 f"{_fmt(s['eval_accuracy_start'])} → {_fmt(s['eval_accuracy_end'])} "
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
    if s["resumed_at"]:
      lines.append(f"- {run.label}: resumed at step {', '.join(map(str, s['resumed_at']))}.")
    if s["episode_turns"] is not None:
      lines.append(f"- {run.label}: episodes of {_fmt(s['episode_turns'], '{:.2f}')} model turns and "
                   f"{_fmt(s['episode_tool_calls'], '{:.2f}')} tool calls on average, "
                   f"{_fmt(s['env_token_share'], '{:.0%}')} of their tokens observations; "
                   f"{_fmt(s['tool_errors'], '{:.0f}')} tool errors, {_fmt(s['episode_faults'], '{:.0f}')} "
                   "episode faults.")
  lines += [
      "", "Tokens/s and sync are medians over the logged steps; *seconds* is the run's time from its first "
      "row, without the downtime between a stop and its resume; *pools busy* is the share of the run's "
      "span window each pool spent in recorded work.", ""
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
  drawn = figures(runs)
  for name, fig in drawn.items():
    _save(fig, os.path.join(out, name))
  summaries = [summarize(r) for r in runs]
  md = os.path.join(out, "report.md")
  with open(md, "w") as f:
    f.write(markdown(runs, summaries, list(drawn), command))
  with open(os.path.join(out, "report.json"), "w") as f:
    json.dump({r.label: s for r, s in zip(runs, summaries)}, f, indent=2)
  return {"figures": [os.path.join(out, name) for name in drawn], "markdown": md}


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
