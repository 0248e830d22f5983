"""Run records: metrics.jsonl (one object per step), spans.jsonl (timed work per pool), and
a progress display: a live rich panel on a terminal, plain log lines otherwise."""
import json
import os
import sys
import threading
import time


class Recorder:

  def __init__(self, workdir: str, append: bool = False):
    os.makedirs(workdir, exist_ok=True)
    mode = "a" if append else "w"
    self._metrics = open(os.path.join(workdir, "metrics.jsonl"), mode)
    self._spans = open(os.path.join(workdir, "spans.jsonl"), mode)
    self._lock = threading.Lock()
    self.t0 = time.time()

  def log(self, row: dict):
    with self._lock:
      self._metrics.write(json.dumps(row) + "\n")
      self._metrics.flush()

  def span(self, pool: str, kind: str, start: float, end: float, **extra):
    """Wall-clock interval (time.time()) during which `pool` did `kind` work."""
    with self._lock:
      self._spans.write(json.dumps(dict(pool=pool, kind=kind, start=start, end=end, **extra)) + "\n")
      self._spans.flush()

  def close(self):
    self._metrics.close()
    self._spans.close()


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


HEADLINE = (("step", "{:.0f}"), ("reward_mean", "{:.3f}"), ("eval_accuracy", "{:.3f}"),
            ("staleness_mean", "{:.2f}"), ("rollout_tokens_per_s", "{:.0f}"),
            ("train_tokens_per_s", "{:.0f}"), ("sync_seconds", "{:.3f}"))


class Progress:
  """Headline figures while a phase runs. Quiet when JAXRL_HEX_QUIET is set (tests)."""

  def __init__(self, title: str, total: int, every: int = 10):
    self.title, self.total, self.every = title, total, max(every, 1)
    self.quiet = bool(os.environ.get("JAXRL_HEX_QUIET"))
    self.live = None
    self.last = {}
    self.t0 = time.time()
    if not self.quiet and sys.stdout.isatty():
      from rich.live import Live
      self.live = Live(self._render(), refresh_per_second=4, transient=False)
      self.live.start()

  def update(self, step: int, row: dict):
    self.last.update({k: v for k, v in row.items() if v is not None})
    if self.quiet:
      return
    if self.live is not None:
      self.live.update(self._render())
    elif step % self.every == 0 or step == self.total or "eval_accuracy" in row:
      print(self._line(), flush=True)

  def _eta(self):
    step = self.last.get("step", 0)
    done = max(step - self.last.get("start_step", 0), 0)
    if not done:
      return "?"
    remaining = (time.time() - self.t0) / done * (self.total - step)
    return f"{remaining:.0f}s"

  def _line(self):
    parts = [f"{self.title} {self.last.get('step', 0)}/{self.total}", f"eta {self._eta()}"]
    parts += [f"{k}={fmt.format(self.last[k])}" for k, fmt in HEADLINE[1:] if k in self.last]
    return " ".join(parts)

  def _render(self):
    from rich.table import Table
    table = Table(title=f"{self.title}  step {self.last.get('step', 0)}/{self.total}  eta {self._eta()}")
    for k, _ in HEADLINE[1:]:
      table.add_column(k)
    table.add_row(*[HEADLINE[i + 1][1].format(self.last[k]) if k in self.last else "-"
                    for i, (k, _) in enumerate(HEADLINE[1:])])
    return table

  def close(self, summary: str = ""):
    if self.live is not None:
      self.live.stop()
    if summary and not self.quiet:
      print(summary, flush=True)
