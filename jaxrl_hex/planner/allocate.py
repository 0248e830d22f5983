"""Allocation: split a cluster into a training pool and rollout replicas, and pick each layout.

The training pool is one device type (one JAX runtime, one mesh), so the outer search walks
the training FLOP share in its natural steps -- every (type, chip count) the platform can run as
one runtime (whole GPU hosts, TPU slice shapes) -- and keeps the best layout for each that the
runtime accepts (batch, heads, KV heads, MLP, vocab and d_model divide). The rollout side is the
AReaL-Hex MILP over replica configurations psi: integer replica counts y_psi and prompt
assignments x_psi (each prompt is a group of G sequences that stays on one replica) with
sum x = batch_size and s_psi + time_psi(G x_psi / y_psi) <= Theta, where s_psi is the replica's
weight-receive pause plus its fixed per-step batch overhead (catalog rollout_overhead_s) and
time_psi(n) = max(a + b*n, c*n) (cost_model.Replica.load_coeffs; c*n is the paper's
n*len/h_psi at full concurrency, a + b*n covers replicas the staleness gate cannot fill).
Multiplied by y_psi, both pieces are linear for a fixed Theta, so the makespan is minimised
by bisection on Theta over feasibility MILPs (scipy.optimize.milp / HiGHS); each of them also
minimises price, so the rollout side is never bigger than it needs to be. Every allocation is
then evaluated at the granularity the runtime runs: whole prompts per replica (split_prompts).
"""
import dataclasses
import heapq
import itertools
import math
import pathlib

import numpy as np
import yaml
from scipy.optimize import Bounds, LinearConstraint, milp

from jaxrl_hex.planner import PlanError, cost_model as cm
from jaxrl_hex.planner.catalog import load_catalog
from jaxrl_hex.planner.model_files import with_lora

OBJECTIVES = ("throughput", "cost")
BISECT_TOL = 1e-4  # relative width at which the makespan bisection stops
PRICE_STEP = 1e-6  # $/h: "strictly cheaper" when walking the cost/makespan frontier
DEVICE_TIEBREAK = 1e-7  # $/h per chip: among equal prices, prefer fewer chips
REL_EQ = 1e-9  # objectives closer than this are ties
# Frontier levels the cost search walks per training split: the cheapest plans sit near the
# balanced point (the outer search also shrinks the trainer), so a few levels suffice; it is
# exact on the small clusters the tests compare with exhaustive search.
COST_LEVELS = 4
# Cheapest-set-that-keeps-pace attempts per split before the fastest set is taken (whole prompts
# per replica can make the MILP's set miss the trainer's pace by a prompt's time).
PACE_RETRIES = 3


@dataclasses.dataclass(frozen=True)
class Cluster:
  counts: dict  # {device type: chips available}, in file order
  catalog: dict  # {device type: catalog.Device}
  workload: cm.Workload
  cores: dict = dataclasses.field(default_factory=dict)  # {cpu device type: the cores its devices share}


def load_cluster(path, catalog_extra=None) -> Cluster:
  """meshes/cluster-*.yaml: cluster: [{type, count, cores}], optional workload:, prices:, catalog:
  (a catalog overlay, inline or a file next to this one; `catalog_extra` goes on top of it).
  `cores` (cpu types only) pins the type's simulated devices to those cores of this machine, as
  the plan's pools will be."""
  path = pathlib.Path(path)
  try:
    data = yaml.safe_load(path.read_text()) or {}
  except FileNotFoundError:
    raise PlanError(f"cluster file {path} not found; pass --cluster meshes/cluster-NAME.yaml") from None
  except yaml.YAMLError as e:
    raise PlanError(f"cluster file {path} is not valid YAML ({str(e).splitlines()[0]})") from None
  if not isinstance(data, dict) or not isinstance(data.get("cluster"), list) or not data["cluster"]:
    raise PlanError(f"cluster file {path}: needs `cluster: [{{type: H100, count: 8}}, ...]`")
  unknown = set(data) - {"cluster", "workload", "prices", "catalog"}
  if unknown:
    raise PlanError(f"cluster file {path}: unknown key(s) {sorted(unknown)}; known: cluster, workload, prices, catalog")
  own = data.get("catalog")
  own = (f"{path}: catalog", own) if isinstance(own, dict) else own and path.parent / own
  catalog = load_catalog([own, catalog_extra], data.get("prices"))
  counts, cores = {}, {}
  for i, entry in enumerate(data["cluster"]):
    if not isinstance(entry, dict) or "type" not in entry or "count" not in entry:
      raise PlanError(f"cluster file {path}: cluster[{i}] needs `type` and `count`")
    kind = str(entry["type"])
    if kind not in catalog:
      raise PlanError(f"cluster file {path}: unknown device type '{kind}'; known: {', '.join(catalog)} "
                      f"(add it with --catalog EXTRA.yaml)")
    if not isinstance(entry["count"], int) or entry["count"] < 1:
      raise PlanError(f"cluster file {path}: cluster[{i}].count must be a positive integer")
    counts[kind] = counts.get(kind, 0) + entry["count"]
    unknown = set(entry) - {"type", "count", "cores"}
    if unknown:
      raise PlanError(f"cluster file {path}: cluster[{i}] has unknown key(s) {sorted(unknown)}; known: type, count, "
                      f"cores")
    if "cores" in entry:
      given = entry["cores"]
      if catalog[kind].platform != "cpu":
        raise PlanError(f"cluster file {path}: cluster[{i}].cores pins simulated cpu devices; {kind} is a "
                        f"{catalog[kind].platform} type, drop `cores`")
      if not isinstance(given, list) or not given or not all(isinstance(c, int) and c >= 0 for c in given):
        raise PlanError(f"cluster file {path}: cluster[{i}].cores must be a list of core numbers, e.g. [0]")
      cores[kind] = cores.get(kind, []) + [c for c in given if c not in cores.get(kind, [])]
  return Cluster(counts, catalog, cm.Workload.from_dict(data.get("workload"), f"{path}: workload"), cores)


# ---------------------------------------------------------------- candidates


@dataclasses.dataclass(frozen=True)
class TrainChoice:
  device_type: str
  layout: cm.TrainLayout
  time: cm.TimeParts  # one step over the workload's tokens
  fixed_s: float  # the part of a step that does not scale with tokens (for the simulator)
  send_s: float  # pushing new weights out to the rollout side
  price_per_hour: float
  seq_len: int = 0  # the micro-batch the memory model sized: `rows` rows of seq_len tokens per batch shard
  rows: int = 1
  whole_batch: bool = False  # the micro-batch holds the step's every sequence (no accumulation)
  memory_bytes: float = 0.0  # cost_model.train_memory of that micro-batch, per chip
  lora: dict = dataclasses.field(default_factory=dict)  # {rank, targets} when only adapters train; {} full FT

  @property
  def step_s(self) -> float:
    return self.time.total_s + self.send_s

  def knobs(self, dev) -> dict:
    """What the planner chose besides the mesh, as the run's config sets it (plan.train)."""
    batch_ways = self.layout.data * self.layout.fsdp
    return {
        "remat": self.layout.remat,
        "sequence_parallel": self.layout.sequence_parallel,  # written as the train pool's rules
        "micro_batch_tokens": 0 if self.whole_batch else batch_ways * self.rows * self.seq_len,  # 0: one micro-batch
        "memory_gb_per_chip": round(self.memory_bytes / 1e9, 2),
        "usable_gb_per_chip": round(cm.MEMORY_HEADROOM * dev.hbm_gb, 2),
        **({
            "lora": self.lora
        } if self.lora else {})  # model.lora: the layout fits because only the adapters train
    }


@dataclasses.dataclass(frozen=True)
class Option:
  """A replica configuration psi for a given training pool (its receive pause depends on it)."""
  replica: cm.Replica
  coeffs: tuple  # (a, b, c): seconds to generate n sequences = max(a + b*n, c*n)
  recv_s: float
  price_per_hour: float
  overhead_s: float = 0.0  # the replica's batch overhead per step (cost_model.Replica.batch_overhead_s)

  @property
  def fixed_s(self) -> float:
    """A replica's seconds per step whatever its load: the weight receive and its batch overhead."""
    return self.recv_s + self.overhead_s

  def seconds(self, n, y):
    """Makespan of y replicas sharing n sequences, weight receive and batch overhead included."""
    a, b, c = self.coeffs
    return self.fixed_s + max(a + b * n / y, c * n / y)


@dataclasses.dataclass(frozen=True)
class Group:
  """Replicas of one configuration that take the same whole number of prompts each."""
  option: Option
  count: int  # replicas
  assigned: int  # sequences of one step over the group: count x prompts per replica x group_size

  def share(self, sequences) -> float:
    """Each replica's fraction of a step's sequences (the mesh file's `share`)."""
    return self.assigned / self.count / sequences


@dataclasses.dataclass(frozen=True)
class Plan:
  objective: str
  workload: cm.Workload
  train: TrainChoice
  groups: tuple  # of Group, count > 0
  rollout_s: float  # makespan of one step's sequences, receive pause included
  step_s: float
  gen_tokens_per_s: float
  price_per_hour: float
  train_flop_share: float
  idle: dict  # {device type: chips left unused}

  @property
  def usd_per_mtok(self) -> float:
    return self.price_per_hour / 3600 / self.gen_tokens_per_s * 1e6

  @property
  def rollout_devices(self) -> dict:
    used = {}
    for g in self.groups:
      used[g.option.replica.device_type] = used.get(g.option.replica.device_type, 0) + g.count * g.option.replica.tensor
    return used


class Problem:
  """A model on a cluster: the cost-model figures every search (planner or exhaustive) shares."""

  def __init__(self, model_cfg, cluster: Cluster, name="model", lora_serving="unmerged"):
    """lora_serving: with LoRA, how replicas apply the adapters (the run's rollout.lora_serving)."""
    self.m = cm.ModelCost.from_config(model_cfg, lora_serving)
    self.cluster, self.w, self.name = cluster, cluster.workload, name
    self.devs = {k: cluster.catalog[k] for k in cluster.counts}
    self.total_flops = sum(self.devs[k].flops * n for k, n in cluster.counts.items())
    self.seq_len = self.w.prompt_len + self.w.output_max
    self.replicas = {
        k: [r for t in cm.tensor_degrees(d) if (r := cm.replica(self.m, d, t, self.w))] for k, d in self.devs.items()
    }

  def train_choice(self, kind, n, layouts=None):
    """Fastest layout of n chips of `kind` (of `layouts`, default every one that fits and that
    the runtime accepts), or None."""
    dev, best = self.devs[kind], None
    if not dev.runtime_sizes_ok(n):
      return None
    for layout in layouts or cm.train_layouts(self.m, dev, n, self.seq_len, self.w.sequences):
      time = cm.train_time(self.m, dev, layout, self.w.trained_tokens, self.seq_len)
      if best is None or time.total_s < best.total_s:
        best, best_layout = time, layout
    if best is None:
      return None
    bw = self._sync_bw(dev, dev)  # the sender's own NIC/link
    fixed = cm.train_time(self.m, dev, best_layout, 0, self.seq_len).total_s
    per_shard = -(-self.w.sequences // (best_layout.data * best_layout.fsdp))
    rows = cm.micro_batch_rows(self.m, dev, best_layout, self.seq_len, per_shard)
    lora = {} if not self.m.lora else {
        "rank": self.m.lora_rank,
        "targets": list(self.m.lora_targets),
        "serving": "merged" if self.m.merged_serving else "unmerged"
    }
    return TrainChoice(kind, best_layout, best, fixed, cm.sync_send_time(self.m, n, bw), n * dev.price_per_hour,
                       self.seq_len, rows, rows >= per_shard,
                       cm.train_memory(self.m, best_layout, self.seq_len, rows, dev.platform), lora)

  def _sync_bw(self, src, dst):
    same_fabric = src.platform == "tpu" or self.cluster.counts[src.name] <= src.chips_per_host
    return cm.sync_bw(src, dst, same_fabric)

  def options(self, train: TrainChoice, limits):
    src = self.devs[train.device_type]
    return [
        Option(r, r.load_coeffs(self.w), cm.sync_recv_time(self.m, r.tensor, self._sync_bw(src, self.devs[k])),
               r.tensor * self.devs[k].price_per_hour, r.batch_overhead_s) for k in limits for r in self.replicas[k]
        if r.tensor <= limits[k]
    ]

  def evaluate(self, objective, train: TrainChoice, counts) -> Plan:
    """Exact figures of one allocation: `counts` is [(Option, y)]; whole prompts per replica come
    from split_prompts (replicas left without a prompt are not used)."""
    used = [(o, y) for o, y in counts if y > 0]
    makespan, groups = split_prompts(used, self.w.batch_size, self.w.group_size)
    rollout_side = makespan + self.w.reward_s
    # eta >= 1 overlaps the sides (AReaL-Hex: max(C_train, C_rollout + C_reward + C_sync));
    # eta = 0 is synchronous RL, where they alternate.
    step = max(train.step_s, rollout_side) if self.w.eta > 0 else train.step_s + rollout_side
    groups = tuple(groups)
    idle = dict(self.cluster.counts)
    idle[train.device_type] -= train.layout.devices
    for g in groups:
      idle[g.option.replica.device_type] -= g.count * g.option.replica.tensor
    return Plan(objective, self.w, train, groups, makespan, step, self.w.sequences * self.w.output_mean / step,
                train.price_per_hour + sum(g.option.price_per_hour * g.count for g in groups),
                train.layout.devices * self.devs[train.device_type].flops / self.total_flops, {
                    k: v for k, v in idle.items() if v
                })

  def splits(self):
    """Every (training choice, rollout chip limits) the outer search considers."""
    for kind, count in self.cluster.counts.items():
      for n in range(1, count + 1):
        train = self.train_choice(kind, n)
        if train is not None:
          limits = dict(self.cluster.counts)
          limits[kind] -= n
          yield train, {k: v for k, v in limits.items() if v}

  def check_feasible(self):
    """Raise a one-line PlanError when the model fits no device or no split hosts a replica."""
    gb = 1e9
    if not any(self.replicas.values()):
      worst = max(self.devs.values(), key=lambda d: d.hbm_gb)
      raise PlanError(
          f"model '{self.name}' fits no device for rollout: {cm.resident_weight_bytes(self.m, 1) / gb:.1f} GB of "
          f"weights plus "
          f"one {self.w.prompt_len}+{self.w.output_max}-token KV cache exceed every type's memory even at the "
          f"largest tensor degree (largest: {worst.name}, {worst.hbm_gb:g} GB x {worst.chips_per_host}); "
          f"add devices with more memory, lower workload.output_len.max, or use a smaller model")
    largest = (
        (k, n) for k, count in self.cluster.counts.items() for n in range(count, 0, -1) if self.train_choice(k, n))
    trainable = list(itertools.islice(largest, 1))
    if not trainable:
      k, n = max(self.cluster.counts.items(), key=lambda kv: kv[1] * self.devs[kv[0]].hbm_gb)
      layout = cm.TrainLayout(1, n, 1, "full")
      need = cm.train_memory(self.m, layout, self.seq_len, 1, self.devs[k].platform) * (1 + cm.TRAIN_MEMORY_MARGIN) / gb
      if cm.train_fits(self.m, self.devs[k], layout, self.seq_len):
        raise PlanError(
            f"no training pool of {k} that the runtime can run: data x fsdp must divide the step's "
            f"{self.w.sequences} sequences (workload.batch_size x group_size), tensor the model's heads, KV heads, "
            f"MLP and vocab, and a GPU pool takes whole hosts of {self.devs[k].chips_per_host}; change "
            f"workload.batch_size or the chip counts")
      lora = "" if self.m.lora else "train LoRA adapters (--lora-rank=16), "
      raise PlanError(
          f"model '{self.name}' fits no device for training: sharded over all {n} {k} it still needs "
          f"{need:.1f} GB per chip (with the memory model's margin) of {cm.MEMORY_HEADROOM * self.devs[k].hbm_gb:.1f} "
          f"GB usable; add chips or larger-memory devices, {lora}lower workload.output_len.max, or use a smaller "
          f"model")
    smallest = min((r.tensor * self.devs[k].price_per_hour, r.tensor, k) for k, rs in self.replicas.items() for r in rs)
    lora = ", or train LoRA adapters (--lora-rank=16): their frozen base needs fewer chips" if (
        not self.m.lora and sum(self.cluster.counts.values()) > 1) else ""
    raise PlanError(
        f"cluster {dict(self.cluster.counts)} cannot host one rollout replica next to a training pool "
        f"(smallest replica: {smallest[1]} x {smallest[2]}; training fits on {trainable[0][1]} x {trainable[0][0]} "
        f"at most); add devices so both pools fit{lora}")


def predict_written(model_cfg, cluster: Cluster, plan_data: dict, name="model") -> Plan:
  """A plan file's allocation (its train pool's layout, its replica groups, full fine-tuning or
  its plan.train.lora) predicted on `cluster`'s catalog and workload: what a refitted catalog
  (`jaxrl-hex calibrate`) says of a plan already written. Prompts are split over its replicas by
  the new speeds, as the router would."""
  knobs = plan_data.get("plan", {}).get("train", {})
  lora = knobs.get("lora") or {}
  model_cfg = with_lora(model_cfg, lora.get("rank", 0), lora.get("targets"), "plan.train.lora")
  prob = Problem(model_cfg, cluster, name, lora.get("serving", "unmerged"))
  pools = plan_data["pools"]
  t, r = pools["train"], pools["rollout"]
  axes = t["mesh"]
  remat = knobs.get("remat", "none")
  sp = (t.get("rules") or {}).get("length") == "tensor"
  layout = cm.TrainLayout(axes.get("data", 1), axes.get("fsdp", 1), axes.get("tensor", 1), remat, sp)
  train = prob.train_choice(t["device_type"], layout.devices, [layout])
  if train is None:
    raise PlanError(f"the plan's train pool ({layout.devices} x {t['device_type']}, mesh {axes}) does not fit the "
                    f"workload on this catalog")
  groups = r.get("replicas") or [{
      "device_type": r["device_type"],
      "count": r["mesh"].get("data", 1),
      "mesh": {
          "tensor": r["mesh"].get("tensor", 1)
      }
  }]
  options = {(o.replica.device_type, o.replica.tensor): o for o in prob.options(train, dict(cluster.counts))}
  counts = {}
  for g in groups:
    key = (g["device_type"], g["mesh"].get("tensor", 1))
    if key not in options:
      raise PlanError(f"the plan's replica group {key[0]} at tensor {key[1]} does not fit the workload on this catalog")
    counts[key] = counts.get(key, 0) + g["count"]
  return prob.evaluate("throughput", train, [(options[k], y) for k, y in counts.items()])


def split_prompts(used, prompts, group_size):
  """Hand `prompts` whole prompts (group_size sequences each, kept on one replica) one at a time
  to the replica that would finish its load earliest; exact for min-max of increasing per-replica
  times. Replicas of one option end up with k or k + 1 prompts, so each option becomes at most two
  Groups; replicas given none are dropped. Returns (makespan, [Group])."""
  if not used:
    return math.inf, []
  replicas = [(i, j) for i, (_, y) in enumerate(used) for j in range(y)]
  load = [0] * len(replicas)
  heap = [(used[i][0].seconds(group_size, 1), r) for r, (i, _) in enumerate(replicas)]
  heapq.heapify(heap)
  for _ in range(prompts):
    _, r = heapq.heappop(heap)
    load[r] += 1
    heapq.heappush(heap, (used[replicas[r][0]][0].seconds((load[r] + 1) * group_size, 1), r))
  groups, makespan = [], 0.0
  for i, (o, _) in enumerate(used):
    per = sorted((load[r] for r, (k, _) in enumerate(replicas) if k == i), reverse=True)
    for n in sorted(set(per) - {0}, reverse=True):
      count = per.count(n)
      groups.append(Group(o, count, count * n * group_size))
      makespan = max(makespan, o.seconds(n * group_size, 1))
  return makespan, groups


# ---------------------------------------------------------------- the MILP


class RolloutMILP:
  """Replica MILP over options psi with per-type chip limits; variables [y_psi..., x_psi...], x in
  prompts of `group_size` sequences."""

  def __init__(self, options, limits, prompts, group_size):
    self.opts, self.P, self.G = options, prompts, group_size
    self.B = sequences = prompts * group_size
    k = len(options)
    self.k = k
    types = list(limits)
    usage = np.zeros((len(types), 2 * k))
    for i, o in enumerate(options):
      usage[types.index(o.replica.device_type), i] = o.replica.tensor
    self.base = [
        LinearConstraint(np.r_[np.zeros(k), np.ones(k)][None], prompts, prompts),
        LinearConstraint(usage, 0, [limits[t] for t in types])
    ]
    self.price = np.array([o.price_per_hour + DEVICE_TIEBREAK * o.replica.tensor for o in options])
    self.y_max = np.array([limits[o.replica.device_type] // o.replica.tensor for o in options], float)
    self.a, self.b, self.c = (np.array(v) for v in zip(*(o.coeffs for o in options)))
    self.fixed = np.array([o.fixed_s for o in options])
    # Fluid bound: every chip of a type at its best saturated per-chip rate.
    per_chip = {}
    for o, c in zip(options, self.c):
      t = o.replica.device_type
      per_chip[t] = max(per_chip.get(t, 0), 1 / (c * o.replica.tensor))
    self.theta_lo = self.fixed.min() + sequences / sum(limits[t] * v for t, v in per_chip.items())

  def min_price(self, theta, price_cap=math.inf):
    """Cheapest y with makespan <= theta (and price <= cap), or None if infeasible."""
    k = self.k
    # s + max(a + b*n/y, c*n/y) <= theta for n = G*x sequences, times y:
    # b*G*x - (theta - s - a)*y <= 0, c*G*x - (theta - s)*y <= 0.
    rows = np.vstack([
        np.hstack([-np.diag(theta - self.fixed - self.a),
                   np.diag(self.b * self.G)]),
        np.hstack([-np.diag(theta - self.fixed), np.diag(self.c * self.G)])
    ])
    cons = self.base + [LinearConstraint(rows, -np.inf, 0)]
    if math.isfinite(price_cap):
      cons.append(LinearConstraint(np.r_[self.price, np.zeros(k)][None], -np.inf, price_cap))
    y_max = np.where(theta - self.fixed - self.a > 0, self.y_max, 0)
    res = milp(np.r_[self.price, np.zeros(k)], constraints=cons, integrality=np.ones(2 * k),
               bounds=Bounds(np.zeros(2 * k), np.r_[y_max, np.full(k, self.P)]))
    if res.x is None:
      return None
    return [int(round(v)) for v in res.x[:k]]

  def min_makespan(self, price_cap=math.inf):
    """Bisect Theta (geometrically) to within BISECT_TOL; returns (theta, y) or None."""
    single = [o.seconds(self.B, 1) for o, p in zip(self.opts, self.price) if p <= price_cap]
    if not single:
      return None
    hi, lo = min(single), self.theta_lo
    y = self.min_price(hi, price_cap)
    if y is None:
      return None
    while hi > lo * (1 + BISECT_TOL):
      mid = math.sqrt(lo * hi)
      got = self.min_price(mid, price_cap)
      if got is None:
        lo = mid
      else:
        hi, y = mid, got
    return hi, y


# ---------------------------------------------------------------- searches


def better(a: Plan, b, objective) -> bool:
  """Throughput: more tokens/s, then cheaper. Cost: fewer $/M tokens, then more tokens/s."""
  if b is None:
    return True
  if objective == "throughput":
    first, second = (b.gen_tokens_per_s, a.gen_tokens_per_s), (a.price_per_hour, b.price_per_hour)
  else:
    first, second = (a.usd_per_mtok, b.usd_per_mtok), (b.gen_tokens_per_s, a.gen_tokens_per_s)
  for lo, hi in (first, second):
    if lo < hi * (1 - REL_EQ) - 1e-12:
      return True
    if lo > hi * (1 + REL_EQ) + 1e-12:
      return False
  return sum(a.rollout_devices.values()) < sum(b.rollout_devices.values())


def plan(model_cfg, cluster: Cluster, objective="throughput", min_throughput=0.0, name="model",
         lora_serving="unmerged") -> Plan:
  """The planner: best plan for `objective`; raises PlanError when nothing is feasible."""
  if objective not in OBJECTIVES:
    raise PlanError(f"objective '{objective}' unknown; use one of {OBJECTIVES}")
  p = Problem(model_cfg, cluster, name, lora_serving)
  w, best, best_any = p.w, None, None
  for train, limits in p.splits():
    opts = p.options(train, limits)
    if not opts:
      continue
    milp_ = RolloutMILP(opts, limits, w.batch_size, w.group_size)
    search = _throughput_search if objective == "throughput" else _cost_search
    for cand in search(p, train, milp_, opts, best, min_throughput):
      if better(cand, best_any, "throughput"):
        best_any = cand
      if cand.gen_tokens_per_s >= min_throughput * (1 - REL_EQ) and better(cand, best, objective):
        best = cand
  if best is None:
    if best_any is not None:
      raise PlanError(f"no allocation reaches --min-throughput {min_throughput:g} tokens/s "
                      f"(the fastest makes {best_any.gen_tokens_per_s:.0f}); lower it or add devices")
    p.check_feasible()
  return best


def _step_for(p, train, theta):
  rollout = theta + p.w.reward_s
  return max(train.step_s, rollout) if p.w.eta > 0 else train.step_s + rollout


def _throughput_search(p, train, milp_, opts, best, _min_throughput):
  w = p.w
  bound = w.sequences * w.output_mean / _step_for(p, train, milp_.theta_lo)
  if best is not None and bound < best.gen_tokens_per_s * (1 - REL_EQ):
    return  # even a perfect rollout side cannot beat the best split found so far
  if w.eta > 0:
    # Train-bound if the rollout can keep up with the trainer: then the cheapest such set. The MILP
    # spreads prompts fractionally over a group's replicas; whole prompts per replica can finish
    # later, so a set that misses the pace is retried against a target lowered by its overshoot.
    pace = target = train.step_s - w.reward_s
    for _ in range(PACE_RETRIES):
      y = milp_.min_price(target)
      if y is None:
        break
      cand = p.evaluate("throughput", train, list(zip(opts, y)))
      yield cand
      if cand.rollout_s <= pace * (1 + BISECT_TOL):
        return
      target -= cand.rollout_s - pace
  _, y = milp_.min_makespan()
  fastest = p.evaluate("throughput", train, list(zip(opts, y)))
  yield fastest
  # Whole prompts per replica can make a cheaper set exactly as fast as the MILP's fastest one.
  y = milp_.min_price(fastest.rollout_s * (1 + BISECT_TOL))
  if y is not None:
    yield p.evaluate("throughput", train, list(zip(opts, y)))


def _cost_floor(p, train, opts, theta_from):
  """A lower bound on $/M tokens over rollout sets with makespan >= theta_from.

  Any set finishing B sequences by Theta holds sum(y/c) >= B / (Theta - s_min) replicas' worth
  of saturated rate, so it costs at least rho * B / (Theta - s_min) with rho the cheapest
  price * seconds-per-sequence; minimised over Theta at the region edges and the stationary point.
  """
  w = p.w
  rho = min(o.price_per_hour * o.coeffs[2] for o in opts)
  s = min(o.fixed_s for o in opts)
  k = rho * w.sequences
  points = [theta_from, train.step_s - w.reward_s]
  if train.price_per_hour > 0 and k > 0:
    points.append(s + math.sqrt(k * (w.reward_s + s) / train.price_per_hour))
  tokens = w.sequences * w.output_mean
  return min((train.price_per_hour + k / (t - s)) * _step_for(p, train, t) / 3600 / tokens * 1e6 for t in points
             if t >= theta_from and t > s)


def _cost_search(p, train, milp_, opts, best, min_throughput):
  """Walk the rollout side's price/makespan frontier from fastest to cheaper, up to COST_LEVELS.

  At each price cap: the fastest makespan Theta_k under the cap, then the cheapest set that is
  no slower than what the step needs (at least Theta_k, at most the trainer's pace). The next
  cap is strictly below that set's price. Stops early when a lower bound on any cheaper set
  cannot beat the best plan, or the throughput floor is crossed.
  """
  w = p.w
  tokens = w.sequences * w.output_mean
  max_step = tokens / min_throughput if min_throughput > 0 else math.inf
  if best is not None and _cost_floor(p, train, opts, milp_.theta_lo) > best.usd_per_mtok * (1 + REL_EQ):
    return
  cap = math.inf
  for _ in range(COST_LEVELS):
    found = milp_.min_makespan(cap)
    if found is None:
      return
    theta, fastest = found
    step = _step_for(p, train, theta)
    if step > max_step * (1 + BISECT_TOL):
      if math.isinf(cap):  # below the floor even at full speed: report it, so the error can say so
        yield p.evaluate("cost", train, list(zip(opts, fastest)))
      return
    if best is not None and _cost_floor(p, train, opts, theta) > best.usd_per_mtok * (1 + REL_EQ):
      return
    target = theta
    if w.eta > 0:
      target = max(theta, min(train.step_s, max_step) - w.reward_s)
    y = milp_.min_price(target, cap)
    cand = p.evaluate("cost", train, list(zip(opts, y)))
    yield cand
    if best is None or better(cand, best, "cost"):
      best = cand
    cap = cand.price_per_hour - train.price_per_hour - PRICE_STEP


def exhaustive_plan(model_cfg, cluster: Cluster, objective="throughput", min_throughput=0.0, name="model",
                    lora_serving="unmerged"):
  """Reference search for small clusters: every split and every replica multiset, no MILP."""
  p = Problem(model_cfg, cluster, name, lora_serving)
  best = None
  for train, limits in p.splits():
    opts = p.options(train, limits)
    per_type = [_type_vectors([o for o in opts if o.replica.device_type == k], limits[k]) for k in limits]
    for combo in itertools.product(*per_type):
      counts = [pair for part in combo for pair in part]
      if sum(y for _, y in counts) == 0:
        continue
      cand = p.evaluate(objective, train, counts)
      if cand.gen_tokens_per_s >= min_throughput * (1 - REL_EQ) and better(cand, best, objective):
        best = cand
  if best is None:
    p.check_feasible()
  return best


def _type_vectors(opts, limit):
  """All [(option, y)] lists for one device type using at most `limit` chips."""
  if not opts:
    yield []
    return
  head, rest = opts[0], opts[1:]
  for y in range(limit // head.replica.tensor + 1):
    for tail in _type_vectors(rest, limit - y * head.replica.tensor):
      yield [(head, y)] + tail


def homogeneous_alternatives(model_cfg, cluster: Cluster, budget_per_hour, objective="throughput", min_throughput=0.0,
                             name="model", lora_serving="unmerged"):
  """For each type in the cluster: the plan on as many of that chip as `budget_per_hour` buys.

  Returns {type: (count, Plan or PlanError)}; types priced at 0 keep their cluster count.
  """
  out = {}
  for kind, have in cluster.counts.items():
    price = cluster.catalog[kind].price_per_hour
    count = int(budget_per_hour // price + 1e-9) if price > 0 else have
    if count < 2:
      out[kind] = (count, PlanError(f"the budget buys {count} {kind}; two pools need at least 2 chips"))
      continue
    solo = dataclasses.replace(cluster, counts={kind: count})
    try:
      out[kind] = (count, plan(model_cfg, solo, objective, min_throughput, name, lora_serving))
    except PlanError as e:
      out[kind] = (count, e)
  return out
