"""Mesh files -> pools: a device subset, a jax Mesh, and the logical-axis rules table.

A pool places any pytree whose leaves carry logical axis names: each name maps through the
rules table to mesh axes, and names whose mesh axes the pool lacks stay replicated. So the
train layout (fsdp, tensor) and the rollout layout (data, tensor) share one table, and a new
layout is a new table in the mesh file, never new code.
"""
import dataclasses
import os

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_hex.errors import UserError
from jaxrl_hex.host_memory import keep_freed_memory

# Logical axis -> mesh axes, in priority order. Axes missing from a pool's mesh are dropped. Each
# use of the model dimension has its own name, so a layout can shard the embedding table, the
# attention projections, the MLP and the output head differently.
DEFAULT_RULES = {
    "batch": ("data", "fsdp"),
    "vocab_in": ("tensor",),  # embedding table rows
    "embed_in": ("fsdp",),  # embedding table columns (the model dimension)
    "qkv_embed": ("fsdp",),  # model dimension of the q, k, v projections
    "o_embed": ("fsdp",),  # model dimension of the attention output projection
    "mlp_up_embed": ("fsdp",),  # model dimension of the gate and up projections
    "mlp_down_embed": ("fsdp",),  # model dimension of the down projection
    "embed_out": ("fsdp",),  # model dimension of the output head
    "vocab_out": ("tensor",),  # output head columns
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "head_dim": (),
    "norm": (),
    "length": (),
    "layers": (),  # the leading axis of scanned layers' stacked params and KV cache (model.scan_layers)
    "lora_rank": (),  # a LoRA adapter's rank axis (models/lora.py): small, never split
}
# A mesh file's `rules:` may set a group at once: `embed` is every model-dimension name above.
RULE_GROUPS = {
    "embed": ("embed_in", "qkv_embed", "o_embed", "mlp_up_embed", "mlp_down_embed", "embed_out"),
    "vocab": ("vocab_in", "vocab_out"),
}
MESH_AXES = ("data", "fsdp", "tensor")


class MeshError(UserError):
  """A mesh file or pool that cannot work; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class ReplicaGroup:
  """Rollout replicas of one kind (a planner output for a mixed fleet): `count` runtimes, each
  holding `devices` devices of `device_type` laid out as `axes`."""
  device_type: str | None
  count: int
  axes: dict  # one replica's mesh, e.g. {tensor: 2}
  share: float | None = None  # the planner's fraction of a batch's sequences for each replica of the group
  affinity: tuple = ()  # per replica, the CPU cores its process is pinned to (Ray backend on one machine)

  @property
  def devices(self) -> int:
    return _size(self.axes)


@dataclasses.dataclass(frozen=True)
class PoolSpec:
  name: str
  device_ids: tuple
  axes: dict  # mesh axis name -> size, in mesh order
  rules: dict
  device_type: str | None = None
  processes: int = 1  # JAX processes forming this pool's runtime (Ray backend)
  hosts: int = 1  # machines those processes span
  replicas: int = 1  # rollout: independent copies of this pool, each its own runtime
  ray_options: dict = dataclasses.field(default_factory=dict)  # per worker actor, e.g. {num_gpus: 4}
  affinity: tuple = ()  # CPU cores its processes are pinned to (Ray backend on one machine)
  groups: tuple = ()  # of ReplicaGroup: rollout replicas of differing type / layout, as the planner writes them

  def partition_spec(self, logical_axes, shape=None, what="array"):
    """Logical axis names -> PartitionSpec over this pool's mesh; checks that each dim divides and
    that no mesh axis shards two dims of one array."""
    parts, used = [], {}  # mesh axis -> the dim (index, logical name) it already shards
    for i, name in enumerate(logical_axes):
      mesh_axes = tuple(a for a in self.rules.get(name, ()) if a in self.axes)
      for a in mesh_axes:
        if a in used:
          j, other = used[a]
          raise MeshError(f"pools.{self.name}: {what} dims {j} ('{other}') and {i} ('{name}') both map to mesh "
                          f"axis '{a}'; a mesh axis shards one dim of an array: change the rule for '{name}' or "
                          f"'{other}' in the mesh file's rules")
      if shape is not None and mesh_axes:
        n = 1
        for a in mesh_axes:
          n *= self.axes[a]
        if shape[i] % n:
          raise MeshError(f"pools.{self.name}: {what} dim {i} ('{name}', size {shape[i]}) does not divide over mesh "
                          f"axes {mesh_axes} (size {n}); change the mesh or the rule for '{name}' in the mesh file")
      used.update({a: (i, name) for a in mesh_axes})
      parts.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*parts)

  def check_shardable(self, axes_tree, shapes_tree):
    """Every parameter divides over this pool's mesh (no devices needed, so drivers check too)."""
    paths = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(shapes_tree)}
    for p, ax in jax.tree_util.tree_leaves_with_path(axes_tree, is_leaf=lambda x: isinstance(x, tuple)):
      self.partition_spec(ax, paths[jax.tree_util.keystr(p)].shape, jax.tree_util.keystr(p))

  def replica_specs(self) -> list:
    """One single-runtime PoolSpec per rollout replica, in group order: each group's layout, or the
    pool's own layout `replicas` times. Device ids count from 0 (each replica is its own runtime)."""
    if not self.groups:
      own = dataclasses.replace(self, device_ids=tuple(range(len(self.device_ids))), replicas=1)
      return [own] * self.replicas
    return [
        PoolSpec(self.name, tuple(range(g.devices)), dict(g.axes), self.rules, g.device_type, 1, 1, 1,
                 dict(self.ray_options),
                 tuple(g.affinity[i]) if g.affinity else ()) for g in self.groups for i in range(g.count)
    ]

  @property
  def batch_ways(self) -> int:
    """How many ways the leading batch dim is split; batches must be a multiple of it."""
    n = 1
    for a in self.rules["batch"]:
      n *= self.axes.get(a, 1)
    return n


@dataclasses.dataclass(frozen=True)
class MeshFile:
  path: str
  platform: str
  num_devices: int | None
  pools: dict  # role -> PoolSpec
  # A plan's workload (`plan.workload` of a file `jaxrl-hex plan` wrote): {batch_size, group_size}, the
  # run's rollout.prompts_per_step and rollout.group_size unless the user sets them; None when hand-written.
  workload: dict | None = None
  # What the planner chose for the train step besides its mesh (`plan.train`): {model.remat,
  # algo.micro_batch_tokens} by config field, the run's unless the user sets them; {} when none.
  train_knobs: dict = dataclasses.field(default_factory=dict)


def load_mesh_file(path: str) -> MeshFile:
  if not os.path.exists(path):
    raise MeshError(
        f"mesh_file: {path!r} does not exist; pass --config.mesh_file=meshes/cpu-8.yaml or another file in meshes/")
  if os.path.isdir(path):
    raise MeshError(f"mesh_file: {path!r} is a directory; name a YAML file, e.g. --config.mesh_file=meshes/cpu-8.yaml")
  with open(path) as f:
    try:
      raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
      raise MeshError(f"{path}: not valid YAML ({_yaml_problem(e)}); correct it there (meshes/cpu-8.yaml shows "
                      "the format)") from None
  raw = {} if raw is None else raw
  if not isinstance(raw, dict):
    raise MeshError(f"{path}: the top level is a {type(raw).__name__}, not a mapping; a mesh file maps keys to values "
                    "(platform: cpu, pools: {train: ..., rollout: ...}), as in meshes/cpu-8.yaml")
  pools_raw = raw.get("pools")
  if not isinstance(pools_raw, dict) or not pools_raw:
    raise MeshError(f"{path}: needs a 'pools:' mapping with 'train' and 'rollout' entries")
  pools, next_id = {}, 0
  for name, p in pools_raw.items():
    if not isinstance(p, dict):
      raise MeshError(f"{path}: pools.{name} is a {type(p).__name__}, not a mapping; give it devices and mesh, "
                      "e.g. {devices: 4, mesh: {data: 4}}")
    mesh = p.get("mesh") or {}
    if not isinstance(mesh, dict) or not all(type(v) is int and v >= 1 for v in mesh.values()):
      raise MeshError(f"{path}: pools.{name}.mesh must map mesh axes to positive sizes, e.g. {{fsdp: 2, tensor: 2}}, "
                      f"not {mesh!r}")
    devices = p.get("devices")
    if isinstance(devices, int):
      ids = tuple(range(next_id, next_id + devices))
    elif isinstance(devices, list) and all(isinstance(d, int) for d in devices):
      ids = tuple(devices)
    else:
      raise MeshError(f"{path}: pools.{name}.devices must be a device count or a list of device ids")
    next_id = max(ids, default=next_id - 1) + 1
    axes = dict(p.get("mesh") or {})
    bad = [a for a in axes if a not in MESH_AXES]
    if bad:
      raise MeshError(f"{path}: pools.{name}.mesh has unknown axes {bad}; use names from {MESH_AXES}")
    groups = _replica_groups(path, name, p.get("replicas"))
    size = sum(g.count * g.devices for g in groups) if groups else _size(axes)
    if size != len(ids):
      what = "its replica groups use" if groups else f"mesh {axes} has"
      raise MeshError(f"{path}: pools.{name}.{'replicas' if groups else 'mesh'}: {what} {size} devices but the "
                      f"pool lists {len(ids)}; make the sizes multiply to the device count")
    rules = _rules(path, name, p.get("rules") or {})
    processes = int(p.get("processes", 1))
    replicas = sum(g.count for g in groups) if groups else int(p.get("replicas", 1))
    if len(ids) % processes:
      raise MeshError(f"{path}: pools.{name} has {len(ids)} devices over {processes} processes; "
                      "make the device count a multiple of processes")
    pools[name] = PoolSpec(name, ids, axes, rules, p.get("device_type"), processes, int(p.get("hosts", 1)), replicas,
                           dict(p.get("ray") or {}), tuple(p.get("affinity") or ()), tuple(groups))
  all_ids = [i for p in pools.values() for i in p.device_ids]
  num_devices = raw.get("num_devices")
  if num_devices is not None and max(all_ids) >= num_devices:
    raise MeshError(f"{path}: the pools use device ids up to {max(all_ids)} but num_devices is {num_devices}; "
                    f"raise num_devices to {max(all_ids) + 1} or shrink the pools")
  if len(set(all_ids)) != len(all_ids) and not raw.get("share_devices", False):
    shared = sorted({i for i in all_ids if all_ids.count(i) > 1})
    raise MeshError(f"{path}: pools share devices {shared}; give each pool its own devices, or set "
                    "share_devices: true (one accelerator: both pools on it, weights held twice)")
  return MeshFile(path, raw.get("platform", "cpu"), num_devices, pools, _plan_workload(path, raw.get("plan")),
                  _plan_train_knobs(path, raw.get("plan")))


def _yaml_problem(e: yaml.YAMLError) -> str:
  """PyYAML's multi-line report as one clause: what is wrong and where (1-based, as editors count)."""
  mark = getattr(e, "problem_mark", None)
  what = " ".join(str(getattr(e, "problem", None) or e).split())
  return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


def _plan_workload(path, plan) -> dict | None:
  """`plan.workload.{batch_size, group_size}` of a planner-written file, or None."""
  workload = plan.get("workload") if isinstance(plan, dict) else None
  if workload is None:
    return None
  out = {}
  for key in ("batch_size", "group_size"):
    value = workload.get(key) if isinstance(workload, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise MeshError(f"{path}: plan.workload.{key} must be a positive integer, got {value!r}; "
                      "write the plan again with `jaxrl-hex plan` or delete the plan block")
    out[key] = value
  return out


# plan.train key -> (the config field it sets, its check)
PLAN_TRAIN_KNOBS = {
    "remat": ("model.remat", lambda v: v in ("none", "dots", "full")),
    "micro_batch_tokens": ("algo.micro_batch_tokens", lambda v: type(v) is int and v >= 0)
}


def _plan_train_knobs(path, plan) -> dict:
  """`plan.train`'s remat and micro-batch of a planner-written file, by config field."""
  train = plan.get("train") if isinstance(plan, dict) else None
  if not isinstance(train, dict):
    return {}
  out = {}
  for key, (field, ok) in PLAN_TRAIN_KNOBS.items():
    if key in train:
      if not ok(train[key]):
        raise MeshError(f"{path}: plan.train.{key}={train[key]!r} is not a valid {field}; "
                        "write the plan again with `jaxrl-hex plan` or delete the key")
      out[field] = train[key]
  lora = train.get("lora")  # a plan that fits only with LoRA adapters (`jaxrl-hex plan --lora-rank=R`)
  if lora is not None:
    if not isinstance(lora, dict) or type(lora.get("rank")) is not int or lora["rank"] < 1:
      raise MeshError(f"{path}: plan.train.lora={lora!r} needs a rank >= 1 (and optionally targets, serving); "
                      "write the plan again with `jaxrl-hex plan --lora-rank=R` or delete the key")
    out["model.lora.rank"] = lora["rank"]
    if "targets" in lora:
      out["model.lora.targets"] = tuple(lora["targets"])
    if "serving" in lora:
      out["rollout.lora_serving"] = lora["serving"]
  return out


def _rules(path, pool, overrides: dict) -> dict:
  """DEFAULT_RULES with a pool's overrides (`name: mesh axis | [axes] | null`, names or RULE_GROUPS)."""
  rules = dict(DEFAULT_RULES)
  for key, value in overrides.items():
    if key not in rules and key not in RULE_GROUPS:
      raise MeshError(f"{path}: pools.{pool}.rules.{key}: unknown logical axis; use one of "
                      f"{sorted(DEFAULT_RULES)} or a group {sorted(RULE_GROUPS)}")
    mesh_axes = tuple([value] if isinstance(value, str) else (value or ()))
    bad = [a for a in mesh_axes if a not in MESH_AXES]
    if bad:
      raise MeshError(f"{path}: pools.{pool}.rules.{key} names unknown mesh axes {bad}; use names from {MESH_AXES}")
    for name in RULE_GROUPS.get(key, (key,)):
      rules[name] = mesh_axes
  return rules


def _size(axes) -> int:
  n = 1
  for v in axes.values():
    n *= int(v)
  return n


def _replica_groups(path, name, replicas) -> list:
  """`replicas: [{device_type, count, mesh: {tensor: T}, share, affinity}]` (a heterogeneous rollout
  side) -> [ReplicaGroup], or [] when `replicas` is a plain count."""
  if not isinstance(replicas, list):
    return []
  groups = []
  for i, g in enumerate(replicas):
    where = f"{path}: pools.{name}.replicas[{i}]"
    if not isinstance(g, dict) or not isinstance(g.get("count"), int) or not isinstance(g.get("mesh"), dict):
      raise MeshError(f"{where} needs count (int) and mesh ({{tensor: T}})")
    bad = [a for a in g["mesh"] if a not in MESH_AXES]
    if bad:
      raise MeshError(f"{where}.mesh has unknown axes {bad}; use names from {MESH_AXES}")
    affinity = tuple(tuple([c] if isinstance(c, int) else c) for c in g.get("affinity") or ())
    if affinity and len(affinity) != g["count"]:
      raise MeshError(
          f"{where}.affinity lists {len(affinity)} core sets for {g['count']} replicas; give one per replica")
    share = g.get("share")
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
      raise MeshError(f"{where}.share must be a number in (0, 1] (each replica's fraction of a batch's sequences), "
                      f"got {share!r}")
    groups.append(ReplicaGroup(g.get("device_type"), g["count"], dict(g["mesh"]), share, affinity))
  _check_shares(path, name, groups)
  return groups


SHARE_TOLERANCE = 1e-3  # how far sum(count x share) may sit from 1 (shares written rounded)


def _check_shares(path, name, groups):
  """Shares are all given or all left to the runtime, and cover the batch once: sum(count x share) = 1."""
  given = [g.share is not None for g in groups]
  if any(given) and not all(given):
    missing = [i for i, has in enumerate(given) if not has]
    raise MeshError(f"{path}: pools.{name}.replicas{missing} have no share while other groups do; give every "
                    "group a share (each replica's fraction of a batch's sequences) or none")
  if all(given) and groups:
    total = sum(g.count * g.share for g in groups)
    if abs(total - 1) > SHARE_TOLERANCE:
      raise MeshError(f"{path}: pools.{name}.replicas: the shares cover {total:.4g} of a batch (sum of count x "
                      "share over the groups); make them sum to 1, or drop share to let the runtime divide the batch")


def check_replica_shares(path, spec: PoolSpec, prompts: int, group_size: int, note: str = ""):
  """Each replica group's share of a batch of `prompts` x `group_size` sequences is whole prompt groups that
  the replica's own batch axes divide, and the groups' prompts add up to the batch (what `jaxrl-hex plan`
  writes; runtime.validate checks it for plan files). `note` (which field overrides a plan, ending in "or ")
  goes into the message before the fix."""
  if not spec.groups or any(g.share is None for g in spec.groups):
    return
  sequences, total = prompts * group_size, 0
  for i, g in enumerate(spec.groups):
    where = f"{path}: pools.{spec.name}.replicas[{i}].share"
    n = g.share * prompts  # prompts per replica of the group
    if abs(n - round(n)) > 1e-3 * max(1.0, n):
      raise MeshError(f"{where} = {g.share:g} gives each replica {g.share * sequences:g} of the {sequences} sequences "
                      f"of a batch (rollout.prompts_per_step x rollout.group_size), not whole prompt groups of "
                      f"{group_size}; {note}make share x {prompts} prompts a whole number (or plan again with "
                      f"`jaxrl-hex plan` for this batch)")
    ways = _size({a: v for a, v in g.axes.items() if a in spec.rules["batch"]})
    if round(n) * group_size % ways:
      raise MeshError(f"{where} gives each replica {round(n) * group_size} sequences, which its batch axes "
                      f"({ways} ways) do not divide; {note}make the share's sequences a multiple of {ways}")
    total += g.count * round(n)
  if total != prompts:
    raise MeshError(f"{path}: pools.{spec.name}.replicas: the shares hand out {total} prompts per batch (sum of count "
                    f"x share x {prompts}) but a batch has rollout.prompts_per_step = {prompts}; {note}make the "
                    "shares sum to 1 over the fleet")


def relayouts(spec: PoolSpec) -> list:
  """Other layouts of a pool's devices that split heads, MLP and vocab less, nearest first: its tensor
  degree lowered step by step, what it gives up going to a batch axis (the pool's own, fsdp on a train
  pool or data on a rollout pool, first), so a model the tensor axis cannot split runs on the same
  devices. Pools of replica groups have a layout per group (check_replica_layouts)."""
  tensor = spec.axes.get("tensor", 1)
  if tensor == 1 or spec.groups:
    return []
  own = [a for a in ("fsdp", "data") if a in spec.axes]
  batch = own + [a for a in (("fsdp", "data") if spec.name == "train" else ("data", "fsdp")) if a not in own]
  out = []
  for degree in (d for d in range(tensor - 1, 0, -1) if tensor % d == 0):
    for axis in batch:
      axes = {a: n for a, n in spec.axes.items() if a != "tensor"}
      axes[axis] = axes.get(axis, 1) * tensor // degree
      out.append(dataclasses.replace(spec, axes=dict(axes, tensor=degree) if degree > 1 else axes))
  return out


def format_axes(axes: dict) -> str:
  """A mesh as a mesh file writes it: {fsdp: 2, tensor: 2}."""
  return "{" + ", ".join(f"{a}: {n}" for a, n in axes.items()) + "}"


def shipped_mesh_files(platform: str) -> list:
  """The repository's hand-written mesh files for one JAX runtime on `platform` (then those for any
  platform): their paths as meshes/NAME.yaml, each loaded; for an error to name one that works."""
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "meshes")
  found = []
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
    try:
      mesh_file = load_mesh_file(os.path.join(root, name))
    except MeshError:  # the planner's cluster descriptions share the directory
      continue
    pools = mesh_file.pools.values()
    if mesh_file.workload is None and all(p.processes == 1 and not p.groups for p in pools):
      found.append((f"meshes/{name}", mesh_file))
  return [f for f in found if f[1].platform == platform] + [f for f in found if f[1].platform == "any"]


def check_replica_layouts(path, spec: PoolSpec, axes_tree, shapes_tree, fix: str):
  """Every replica group's own layout shards the policy (check_shardable on each of replica_specs());
  the message names the group, pools.NAME.replicas[i], and `fix`."""
  replicas, first = spec.replica_specs(), 0
  for i, g in enumerate(spec.groups):
    try:
      replicas[first].check_shardable(axes_tree, shapes_tree)
    except MeshError as e:
      detail = str(e).removeprefix(f"pools.{spec.name}: ").split("; ")[0]
      raise MeshError(f"{path}: pools.{spec.name}.replicas[{i}] (device_type {g.device_type}, mesh {g.axes}): "
                      f"{detail}; {fix}") from None
    first += g.count


def prepare_cpu_devices(n: int):
  """Ask for n simulated CPU devices (and, under JAXRL_HEX_MALLOC=keep, keep freed host buffers:
  host_memory); must run before JAX initialises its backends."""
  keep_freed_memory()
  try:
    jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices or 1))
  except RuntimeError:  # JAX already started (a notebook): keep what it has
    if len(jax.devices("cpu")) < n:
      raise MeshError(f"the mesh file wants {n} simulated CPU devices but JAX already started with "
                      f"{len(jax.devices('cpu'))}; restart Python and call jaxrl_hex.meshes.prepare_cpu_devices({n}) "
                      "before any JAX operation") from None


class Pool:
  """One role's devices and mesh; places pytrees of logical axes as NamedShardings."""

  def __init__(self, spec: PoolSpec, devices=None):
    available = devices if devices is not None else jax.devices()
    if max(spec.device_ids) >= len(available):
      raise MeshError(f"pools.{spec.name} needs device ids up to {max(spec.device_ids)} but only {len(available)} "
                      f"{available[0].platform} devices exist; shrink the pool's mesh or run on more devices")
    if spec.groups:
      raise MeshError(f"pools.{spec.name} has replica groups of differing layouts (a planner output for a "
                      "mixed cluster); one runtime cannot hold them: run each group as its own mesh file")
    self.spec = spec
    self.name = spec.name
    self.devices = [available[i] for i in spec.device_ids]
    shape = tuple(spec.axes.values()) or (1,)
    names = tuple(spec.axes) or ("data",)
    self.mesh = Mesh(np.array(self.devices).reshape(shape), names)

  @property
  def axis_sizes(self) -> dict:
    return dict(self.mesh.shape)

  def partition_spec(self, logical_axes, shape=None, what="array"):
    return self.spec.partition_spec(logical_axes, shape, what)

  def sharding(self, logical_axes, shape=None, what="array"):
    return NamedSharding(self.mesh, self.partition_spec(logical_axes, shape, what))

  def shardings_for(self, axes_tree, shapes_tree):
    """Pytrees of logical axes and ShapeDtypeStructs -> pytree of NamedShardings."""
    paths = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(shapes_tree)}
    return jax.tree_util.tree_map_with_path(
        lambda p, ax: self.sharding(ax, paths[jax.tree_util.keystr(p)].shape, jax.tree_util.keystr(p)), axes_tree,
        is_leaf=lambda x: isinstance(x, tuple))

  def replicated(self):
    return NamedSharding(self.mesh, PartitionSpec())

  def activation_sharding(self, logical_axes, shape):
    """An activation's sharding by its logical axes (models.sharding.constrain), or None where a
    dim does not divide: unlike a parameter, an activation may be too small to split."""
    try:
      return self.sharding(logical_axes, shape)
    except MeshError:
      return None

  @property
  def batch_ways(self) -> int:
    return self.spec.batch_ways

  def describe(self) -> dict:
    return {
        "role": self.name,
        "devices": [d.id for d in self.devices],
        "platform": self.devices[0].platform,
        "mesh": self.axis_sizes
    }


def build_pools(mesh_file: MeshFile, devices=None) -> dict:
  return {name: Pool(spec, devices) for name, spec in mesh_file.pools.items()}


def to_host(tree):
  """device_get that also works in a multi-process runtime, where arrays sharded over other
  processes' devices are gathered (a collective: every process of the runtime must call it)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return jax.tree.map(
      lambda x: jax.device_get(x)
      if getattr(x, "is_fully_addressable", True) else multihost_utils.process_allgather(x, tiled=True), tree)


def local_device(pool) -> jax.Device:
  """A device of `pool` that this process owns (for queries like memory_stats)."""
  return next(d for d in pool.devices if d.process_index == jax.process_index())
