"""Run records and what a person watches while a run goes.

Recorder writes metrics.jsonl (one object per step), spans.jsonl (timed work per pool) and, for
every logged row, TensorBoard scalars under WORKDIR/tb (and W&B when log.wandb_project is set).
Progress shows the headline figures: a live rich panel on a terminal, plain log lines otherwise.
"""
import collections
import json
import numbers
import os
import sys
import threading
import time
import traceback

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from tensorboardX import SummaryWriter

from jaxrl_hex.errors import UserError

TB_DIR = "tb"


def _open_append(path, truncate):
  if truncate:
    open(path, "w").close()
  return open(path, "a")


class Recorder:

  def __init__(self, workdir: str, append: bool = False, config=None):
    """`config` (the run config) switches the sinks: log.tensorboard, log.wandb_project."""
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    log = config.get("log", {}) if config is not None else {}
    self._wandb = _start_wandb(workdir, config, append) if log.get("wandb_project") else None
    self._tb = None
    if log.get("tensorboard", True):
      # flush often enough that `tensorboard --logdir WORKDIR/tb` follows a live run
      self._tb = SummaryWriter(os.path.join(workdir, TB_DIR), flush_secs=10)
    # appends even on a fresh run (truncated first): a Ray train worker appends its warm-start rows
    self._metrics = _open_append(os.path.join(workdir, "metrics.jsonl"), truncate=not append)
    self._spans = _open_append(os.path.join(workdir, "spans.jsonl"), truncate=not append)
    self._lock = threading.Lock()
    self.t0 = time.time()

  def resume_at(self, step: int):
    """A run resumed from its checkpoint at `step`: the train rows the stopped run wrote after it
    go (the resumed run writes them again), so metrics.jsonl keeps one row per step."""
    with self._lock:
      path = self._metrics.name
      self._metrics.close()
      with open(path) as f:
        rows = [line for line in f if line.strip()]
      keep = [line for line in rows if not _after(json.loads(line), step)]
      with open(path + ".tmp", "w") as f:
        f.writelines(keep)
      os.replace(path + ".tmp", path)
      self._metrics = open(path, "a")

  def log(self, row: dict):
    """One step's figures; `phase` (sft, warmstart, train) prefixes the TensorBoard tags."""
    with self._lock:
      self._metrics.write(json.dumps(row) + "\n")
      self._metrics.flush()
      scalars, hists = tb_values(row)
      step = int(row.get("step", 0))
      walltime = self.t0 + row["wall_s"] if "wall_s" in row else None
      if self._tb is not None:
        for tag, value in scalars.items():
          self._tb.add_scalar(tag, value, step, walltime=walltime)
        for tag, counts in hists.items():
          self._tb.add_histogram_raw(tag, **_raw_histogram(counts), global_step=step, walltime=walltime)
      if self._wandb is not None:
        import wandb
        self._wandb.log({
            **scalars, f"{row.get('phase', 'run')}/step": step,
            **{
                t: wandb.Histogram(np_histogram=_np_histogram(c)) for t, c in hists.items()
            }
        })

  def span(self, pool: str, kind: str, start: float, end: float, **extra):
    """Wall-clock interval (time.time()) during which `pool` did `kind` work."""
    with self._lock:
      self._spans.write(json.dumps(dict(pool=pool, kind=kind, start=start, end=end, **extra)) + "\n")
      self._spans.flush()

  def close(self):
    self._metrics.close()
    self._spans.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()


def thread_stacks() -> str:
  """Every thread's stack in this process, as text (what the watchdog writes when a run stalls)."""
  names = {t.ident: t.name for t in threading.enumerate()}
  return "\n".join(f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
                   for ident, frame in sys._current_frames().items())


def _after(row: dict, step: int) -> bool:
  return row.get("phase") == "train" and row.get("step", 0) > step


def tb_values(row: dict):
  """A metrics row -> ({tag: number}, {tag: {value: count}}), tags "phase/key"; the rest is not a metric."""
  phase = row.get("phase", "run")
  scalars, hists = {}, {}
  for key, value in row.items():
    if key in ("phase", "step"):
      continue
    if isinstance(value, numbers.Real):
      scalars[f"{phase}/{key}"] = float(value)
    elif isinstance(value, dict) and value and all(isinstance(c, numbers.Real) for c in value.values()):
      hists[f"{phase}/{key}"] = {float(k): int(c) for k, c in value.items()}
  return scalars, hists


def _raw_histogram(counts: dict) -> dict:
  """{value: count} of small integers (staleness) -> one bucket per value, edges at value + 0.5."""
  values = sorted(counts)
  n = sum(counts.values())
  return dict(min=values[0], max=values[-1], num=n, sum=sum(v * c for v, c in counts.items()),
              sum_squares=sum(v * v * c for v, c in counts.items()), bucket_limits=[v + 0.5 for v in values],
              bucket_counts=[counts[v] for v in values])


def _np_histogram(counts: dict):
  values = sorted(counts)
  return [counts[v] for v in values], [v - 0.5 for v in values] + [values[-1] + 0.5]


def _start_wandb(workdir, config, append):
  try:
    import wandb
  except ImportError:
    raise UserError("log.wandb_project is set but wandb is not installed; `pip install wandb`, "
                    "or leave --config.log.wandb_project empty") from None
  log = config.log
  run = wandb.init(project=log.wandb_project, entity=log.get("wandb_entity") or None, name=log.get("wandb_run_name") or
                   os.path.basename(os.path.abspath(workdir)), dir=workdir, config=config.to_dict(),
                   resume="allow" if append else None)
  for phase in ("sft", "warmstart", "train"):  # phases restart their step count: one x-axis each
    run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
  return run


def covered_seconds(spans, lo, hi) -> float:
  """Seconds of [lo, hi] inside the union of the (start, end) spans (busy time of overlapping work)."""
  total, reach = 0.0, lo
  for start, end in sorted(spans):
    start, end = max(start, reach), min(end, hi)
    if end > start:
      total += end - start
      reach = end
  return total


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


# Headline figures in display order: (row key, label, format); absent keys are left out.
HEADLINE = (("reward_mean", "reward", "{:.3f}"), ("eval_accuracy", "eval acc", "{:.3f}"), ("loss", "loss", "{:.4f}"),
            ("token_accuracy", "token acc", "{:.3f}"), ("staleness_mean", "staleness", "{:.2f}"),
            ("episode_turns", "turns", "{:.2f}"), ("rollout_tokens_per_s", "rollout tok/s", "{}"),
            ("train_tokens_per_s", "train tok/s", "{}"), ("sync_seconds", "sync", "{}"))
# Faults shown as soon as they happen, beside the headline: (row key, label) of counts the rows carry
# cumulatively; updates skipped for a non-finite loss or gradient are summed from each row's count.
FAULTS = (("reward_errors", "reward errors"), ("rollout_restarts", "replica restarts"), ("tool_errors", "tool errors"),
          ("episode_faults", "episode faults"))


def _si(x: float) -> str:
  return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _format(key, fmt, value) -> str:
  if key.endswith("tokens_per_s"):
    return _si(value)
  if key == "sync_seconds":
    return f"{value * 1e3:.1f}ms"
  return fmt.format(value)


class Progress:
  """Step, ETA and the headline figures while a phase runs. Quiet when JAXRL_HEX_QUIET is set (tests).

  On a terminal a rich panel redraws in place; otherwise (a log file, a notebook cell, CI) one
  plain line every `every` steps and on each evaluation, with no control codes.

  target (row key, value): the phase stops once that figure reaches the value, usually long
  before `total` (the SFT warm start's accuracy target). `total` is then only a cap: the line
  says so, shows no percentage of it, and the time to it is an upper bound ("eta <= ..."); the
  panel's bar is the figure's way to its target.
  """

  WINDOW = 50  # steps the ETA's rate is measured over: compile time fades out of it

  def __init__(self, title: str, total: int, every: int = 10, stream=None, unit: str = "step", target=None):
    self.title, self.total, self.every, self.unit, self.target = title, total, max(every, 1), unit, target
    self.stream = stream or sys.stdout
    self.quiet = bool(os.environ.get("JAXRL_HEX_QUIET"))
    self.last = {}
    self.best_eval = None
    self.skipped = 0  # updates skipped for a non-finite loss or gradient, over the phase
    self.t0 = time.time()
    self._times = collections.deque(maxlen=self.WINDOW + 1)  # (time, step)
    self._printed = 0  # the step of the last plain line
    self.live = None
    if not self.quiet and self.stream.isatty():
      self.live = Live(self._render(), console=Console(file=self.stream), refresh_per_second=4)
      self.live.start()

  def update(self, step: int, row: dict):
    faults = self.faults()
    self.last.update({k: v for k, v in row.items() if v is not None})
    self.last["step"] = step
    self.skipped += int(row.get("nonfinite_updates") or 0)
    news = self.faults() != faults  # a new fault gets its line now, not at the next `every`
    self._times.append((time.time(), step))
    if row.get("eval_accuracy") is not None:
      self.best_eval = max(self.best_eval or 0.0, row["eval_accuracy"])
    if self.quiet:
      return
    if self.live is not None:
      self.live.update(self._render())
    elif (step // self.every > self._printed // self.every or step == self.total or
          row.get("eval_accuracy") is not None or news):  # steps may jump (generate counts samples)
      self._printed = step
      print(self.line(), file=self.stream, flush=True)

  def rate(self):
    """Steps per second over the last WINDOW steps; None before two steps are seen."""
    if len(self._times) < 2:
      return None
    (t_a, s_a), (t_b, s_b) = self._times[0], self._times[-1]
    return (s_b - s_a) / (t_b - t_a) if s_b > s_a and t_b > t_a else None

  def eta(self) -> str:
    rate = self.rate()
    if rate is None:
      return "?"
    left = _duration((self.total - self.last.get("step", 0)) / rate)
    return f"<= {left}" if self.target else left

  def _goal(self) -> str:
    """'stops at eval acc 0.400' for a target, naming the figure as the headline does."""
    key, value = self.target
    label, fmt = next(((label, fmt) for k, label, fmt in HEADLINE if k == key), (key, "{:.3f}"))
    return f"stops at {label} {fmt.format(value)}"

  def faults(self) -> list:
    """(label, count) of the faults so far: reward errors, replica restarts, skipped updates."""
    out = [(label, int(self.last[key])) for key, label in FAULTS if self.last.get(key)]
    return out + ([("skipped updates", self.skipped)] if self.skipped else [])

  def figures(self):
    """(label, text) pairs for the headline keys present, then the faults so far."""
    out = []
    for key, label, fmt in HEADLINE:
      if key in self.last and isinstance(self.last[key], numbers.Real):
        text = _format(key, fmt, self.last[key])
        if key == "eval_accuracy" and self.best_eval is not None:
          text += f" (best {self.best_eval:.3f})"
        if key == "staleness_mean" and "staleness_max" in self.last:
          text += f" (max {self.last['staleness_max']})"
        out.append((label, text))
    return out + [(label, str(count)) for label, count in self.faults()]

  def line(self) -> str:
    step = self.last.get("step", 0)
    rate = self.rate()
    if self.target:
      head = [f"{self.title} {step} (up to {self.total}, {self._goal()})"]
    else:
      head = [f"{self.title} {step}/{self.total}", f"{100 * step / max(self.total, 1):.0f}%"]
    head += [f"elapsed {_duration(time.time() - self.t0)}", f"eta {self.eta()}"]
    if rate is not None:
      head.append(f"{rate:.2f} {self.unit}/s")
    return " | ".join([" ".join(head)] + [f"{label} {text}" for label, text in self.figures()])

  def _render(self):
    step = self.last.get("step", 0)
    rate = self.rate()
    grid = Table.grid(padding=(0, 2))
    title = self.title
    if self.target:  # the bar is the way to the target; the step count is a cap, named in the title
      key, value = self.target
      reached = (self.best_eval or 0.0) if key == "eval_accuracy" else self.last.get(key, 0.0)
      bar, count = ProgressBar(total=max(value, 1e-9), completed=min(reached, value), width=40), f"step {step}"
      title = f"{self.title}: up to {self.total} steps, {self._goal()}"
    else:
      bar, count = ProgressBar(total=max(self.total, 1), completed=step, width=40), f"{step}/{self.total}"
    grid.add_row(bar, count, f"elapsed {_duration(time.time() - self.t0)}", f"eta {self.eta()}",
                 "" if rate is None else f"{rate:.2f} {self.unit}/s")
    figures = Table.grid(padding=(0, 3))
    pairs = self.figures()
    for _ in pairs:
      figures.add_column(justify="right")
    if pairs:
      figures.add_row(*[f"[dim]{label}[/dim]" for label, _ in pairs])
      figures.add_row(*[text for _, text in pairs])
    return Panel(Group(grid, figures), title=title, title_align="left")

  def close(self, summary: str = ""):
    if self.live is not None:
      self.live.update(self._render())
      self.live.stop()
    if summary and not self.quiet:
      print(summary, file=self.stream, flush=True)
