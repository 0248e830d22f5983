"""Discrete-event simulation of the async RL loop a plan describes.

Replicas decode up to `slots` sequences at once; a decode step over c running sequences takes
step_fixed_s + step_per_seq_s * c. New sequences go to the least-loaded replica; admitting one
stalls that replica for its prefill, and a weight sync stalls it for its receive time
(interruptible generation: in-flight sequences resume afterwards). The staleness gate admits
the g-th rollout only while floor((g - 1) / B) <= version + eta. The trainer takes the B
oldest finished trajectories, trains for fixed + per-token time, and publishes a version.
"""
import dataclasses
import heapq
import math

import numpy as np

from jaxrl_hex.planner import PlanError
from jaxrl_hex.planner.cost_model import Workload


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
  device_type: str
  tensor: int
  slots: int
  step_fixed_s: float
  step_per_seq_s: float
  prefill_s: float
  recv_s: float
  overhead_s: float = 0.0  # per step, beside prefill and decode (older plan files: none)


@dataclasses.dataclass(frozen=True)
class SimSpec:
  """What the simulator needs from a plan: all of it lives in a plan file's `plan.sim`."""
  workload: Workload
  train_fixed_s: float
  train_per_token_s: float
  replicas: tuple  # of ReplicaSpec, one per replica

  @classmethod
  def from_plan_file(cls, data, where="plan file") -> "SimSpec":
    try:
      plan = data["plan"]
      sim = plan["sim"]
      replicas = tuple(
          ReplicaSpec(g["device_type"], int(g["tensor"]), int(g["slots"]), float(g["step_fixed_s"]),
                      float(g["step_per_seq_s"]), float(g["prefill_s"]), float(g["recv_s"]),
                      float(g.get("overhead_s", 0.0))) for g in sim["replicas"] for _ in range(int(g["count"])))
      return cls(Workload.from_dict(plan["workload"], f"{where}: plan.workload"), float(sim["train_fixed_s"]),
                 float(sim["train_per_token_s"]), replicas)
    except (KeyError, TypeError) as e:
      raise PlanError(f"{where}: missing plan.sim field {e}; write the file with `jaxrl-hex plan --out`") from None


@dataclasses.dataclass
class SimResult:
  steps: int
  duration_s: float
  gen_tokens_per_s: float  # steady state: after the first trainer step
  trained_tokens_per_s: float
  trainer_idle_frac: float  # trainer waiting for a full batch
  rollout_idle_frac: float  # replica-time with nothing in flight (gate closed or no slot work)
  rollout_slot_util: float  # busy slot-time over all slot-time
  sync_frac: float  # replica-time paused for weight syncs
  staleness: dict  # {versions behind: samples}
  train_segments: list = dataclasses.field(repr=False)  # (start, end)
  replica_busy: list = dataclasses.field(repr=False)  # per replica [(start, end)]
  replica_sync: list = dataclasses.field(repr=False)  # per replica [(start, end)]

  def summary(self) -> dict:
    return {
        k: v for k, v in dataclasses.asdict(self).items() if k not in ("train_segments", "replica_busy", "replica_sync")
    }


class _Replica:
  """Token clock (decode steps done) that stops while paused and ticks at the current step
  time; in-flight sequences finish when it reaches their admission value plus their length."""

  def __init__(self, spec):
    self.spec = spec
    self.work, self.last, self.paused_until = 0.0, 0.0, 0.0
    self.inflight = []  # heap of (work finish, request id)
    self.epoch = 0  # only the latest scheduled finish event of a replica is live
    self.held = 0.0  # slot-seconds held by in-flight sequences
    self.busy_since = None

  def step_s(self):
    return self.spec.step_fixed_s + self.spec.step_per_seq_s * len(self.inflight)

  def advance(self, now):
    """Call before anything that changes the running set, so each stretch uses its own step time."""
    if self.inflight:
      self.work += max(0.0, now - max(self.last, self.paused_until)) / self.step_s()
      self.held += len(self.inflight) * (now - self.last)
    self.last = now

  def pause(self, now, seconds):
    self.advance(now)
    self.paused_until = max(self.paused_until, now) + seconds

  def next_finish(self, now):
    if not self.inflight:
      return None
    return max(self.paused_until, now) + (self.inflight[0][0] - self.work) * self.step_s()


def _lengths(w: Workload, rng, n):
  if w.output_dist == "fixed":
    out = np.full(n, w.output_mean)
  elif w.output_dist == "uniform":
    out = rng.uniform(1, 2 * w.output_mean - 1, n)
  else:  # lognormal with the requested mean
    mu = math.log(w.output_mean) - w.output_sigma**2 / 2
    out = rng.lognormal(mu, w.output_sigma, n)
  return np.clip(np.rint(out), 1, w.output_max).astype(int)


def simulate(spec: SimSpec, steps=30, seed=0) -> SimResult:
  w, rng = spec.workload, np.random.default_rng(seed)
  B = w.sequences
  replicas = [_Replica(r) for r in spec.replicas]
  lengths = _lengths(w, rng, B * (steps + w.eta + 2))
  events, counter = [], [0]

  def push(t, kind, payload):
    counter[0] += 1
    heapq.heappush(events, (t, counter[0], kind, payload))

  generated, version, trainer_busy = 0, 0, False
  start_version, buffer = {}, []  # request -> version at admission; finished (ready time, id)
  staleness, train_segments, step_ends = {}, [], []
  busy = [[] for _ in replicas]
  sync = [[] for _ in replicas]
  trained_tokens = 0

  def schedule(i, now):
    r = replicas[i]
    t = r.next_finish(now)
    r.epoch += 1
    if t is not None:
      push(t, "finish", (i, r.epoch))

  def admit(now):
    nonlocal generated
    touched = set()
    while generated < len(lengths) and generated // B <= version + w.eta:
      i = min(range(len(replicas)), key=lambda k: len(replicas[k].inflight) / replicas[k].spec.slots)
      r = replicas[i]
      if len(r.inflight) >= r.spec.slots:
        break
      req = generated
      generated += 1
      # prefill stalls the replica's decoding (advances its clock); a prompt's G samples share it
      r.pause(now, r.spec.prefill_s / w.group_size)
      heapq.heappush(r.inflight, (r.work + lengths[req], req))
      start_version[req] = version
      if r.busy_since is None:
        r.busy_since = now
      touched.add(i)
    for i in touched:
      schedule(i, now)

  def try_train(now):
    nonlocal trainer_busy, trained_tokens
    if trainer_busy or len(buffer) < B:
      return
    buffer.sort()
    batch, buffer[:] = buffer[:B], buffer[B:]
    tokens = sum(w.prompt_len + lengths[req] for _, req in batch)
    for _, req in batch:
      lag = version - start_version.pop(req)
      staleness[lag] = staleness.get(lag, 0) + 1
    trainer_busy = True
    duration = spec.train_fixed_s + spec.train_per_token_s * tokens
    train_segments.append((now, now + duration))
    trained_tokens += tokens
    push(now + duration, "trained", sum(lengths[req] for _, req in batch))

  admit(0.0)
  gen_after_first = 0
  while events and len(step_ends) < steps:
    now, _, kind, payload = heapq.heappop(events)
    if kind == "finish":
      i, epoch = payload
      r = replicas[i]
      if epoch != r.epoch:
        continue
      r.advance(now)
      while r.inflight and r.inflight[0][0] <= r.work + 1e-9:
        _, req = heapq.heappop(r.inflight)
        push(now + w.reward_s, "rewarded", req)
      if not r.inflight:
        busy[i].append((r.busy_since, now))
        r.busy_since = None
      admit(now)
      schedule(i, now)
    elif kind == "rewarded":
      buffer.append((now, payload))
      try_train(now)
    elif kind == "trained":
      trainer_busy = False
      version += 1
      step_ends.append(now)
      if len(step_ends) > 1:
        gen_after_first += payload
      for i, r in enumerate(replicas):  # publish: every replica pauses to receive its shard, then its per-step overhead
        sync[i].append((now, now + r.spec.recv_s))
        r.pause(now, r.spec.recv_s + r.spec.overhead_s)
        schedule(i, now)
      admit(now)
      try_train(now)
  end = step_ends[-1] if step_ends else 0.0
  for i, r in enumerate(replicas):
    r.advance(end)
    if r.busy_since is not None:
      busy[i].append((r.busy_since, end))
  return _result(spec, steps, end, step_ends, gen_after_first, trained_tokens, staleness, train_segments, busy, sync,
                 sum(r.held for r in replicas))


def _clip_total(segments, end):
  return sum(max(0.0, min(b, end) - a) for a, b in segments)


def _result(spec, steps, end, step_ends, gen_after_first, trained_tokens, staleness, train_segments, busy, sync,
            slot_seconds):
  n = len(spec.replicas)
  steady = step_ends[-1] - step_ends[0] if len(step_ends) > 1 else math.inf
  replica_time = n * end if end else math.inf
  total_slots = sum(r.slots for r in spec.replicas)
  return SimResult(steps=len(step_ends), duration_s=end, gen_tokens_per_s=gen_after_first / steady,
                   trained_tokens_per_s=trained_tokens / end if end else 0.0,
                   trainer_idle_frac=1 - _clip_total(train_segments, end) / end if end else 1.0,
                   rollout_idle_frac=max(0.0, 1 - sum(_clip_total(b, end) for b in busy) / replica_time),
                   rollout_slot_util=slot_seconds / (total_slots * end) if end else 0.0,
                   sync_frac=sum(_clip_total(s, end) for s in sync) / replica_time, staleness=dict(
                       sorted(staleness.items())), train_segments=train_segments, replica_busy=busy, replica_sync=sync)


MAX_ROWS = 32  # replicas drawn; the rest are summarised in the title


def draw_timeline(result: SimResult, spec: SimSpec, path, title=""):
  """Timeline PNG: trainer steps, each replica's generating and weight-sync intervals, staleness."""
  fig = timeline_figure(result, spec, title)
  import matplotlib.pyplot as plt
  fig.savefig(path, dpi=110)
  plt.close(fig)


def timeline_figure(result: SimResult, spec: SimSpec, title=""):
  """The timeline's figure (the caller saves and closes it). Bars are drawn to scale, without
  edges: an edge would widen each short weight sync by a pixel."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  rows = min(len(spec.replicas), MAX_ROWS)
  fig, (ax, hist) = plt.subplots(1, 2, figsize=(14, 2.4 + 0.3 * rows), width_ratios=[4, 1])
  bars = dict(linewidth=0, snap=False)
  ax.broken_barh([(a, b - a) for a, b in _joined(result.train_segments)], (rows + 0.6, 0.8), color="tab:blue", **bars)
  for i in range(rows):
    ax.broken_barh([(a, b - a) for a, b in result.replica_busy[i]], (i + 0.1, 0.8), color="tab:green", **bars)
    ax.broken_barh([(a, b - a) for a, b in result.replica_sync[i]], (i + 0.1, 0.8), color="tab:red", **bars)
  ax.set_yticks([i + 0.5 for i in range(rows)] + [rows + 1.0])
  ax.set_yticklabels([f"{r.device_type} tp{r.tensor} #{i}" for i, r in enumerate(spec.replicas[:rows])] + ["trainer"],
                     fontsize=7)
  ax.set_ylim(0, rows + 1.5)
  ax.set_xlim(0, result.duration_s)
  ax.set_xlabel("seconds")
  more = f" (+{len(spec.replicas) - rows} replicas not drawn)" if len(spec.replicas) > rows else ""
  fig.suptitle(
      f"{title} {result.gen_tokens_per_s:,.0f} generated tok/s; trainer idle {result.trainer_idle_frac:.0%}, "
      f"rollout idle {result.rollout_idle_frac:.0%}, weight sync {result.sync_frac:.1%}{more}", fontsize=9)
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:green", "tab:red")]
  # on a line of its own above the axes: inside, it would cover the trainer's row
  ax.legend(handles, ["train step", "generating", "weight sync"], loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3,
            fontsize=7, frameon=False, borderaxespad=0.2)
  hist.bar(list(result.staleness), list(result.staleness.values()), color="tab:gray")
  hist.xaxis.set_major_locator(MaxNLocator(integer=True))  # as many whole versions as fit without overlap
  hist.set_xlabel(f"staleness (eta={spec.workload.eta})")
  hist.set_ylabel("samples")
  fig.tight_layout()
  return fig


def _joined(segments):
  """Sorted (start, end) segments with back-to-back ones joined: bars that touch leave a pale seam
  where their antialiased edges meet, which would read as idle time."""
  out = []
  for a, b in segments:
    if out and a <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], b))
    else:
      out.append((a, b))
  return out
