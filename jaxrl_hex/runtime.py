"""What every command builds first: the task, the mesh file and the policy, checked against the
config and each other before any work starts. Pools (which need devices) are built on first use,
in whichever JAX runtime asks: the driver, or a Ray worker building its own runtime.

The config's single fields are checked in config.py; the checks here need the layers below this
one (the algorithm registry, the sync methods, the mesh file, the task's tokenizer). The backend
checks live with the backends (cluster/__init__.py).
"""
import dataclasses
import math
import os
import sys
import typing

import jax

from jaxrl_hex import footprint, meshes
from jaxrl_hex.config import DEFAULT_MESH_FILE, resolve_path, validate_fields
from jaxrl_hex.errors import ConfigError, UserError
from jaxrl_hex.models.config import AUTO, AUTO_FIELDS, DEFAULTS, auto_dtype, auto_scan_layers, model_config
from jaxrl_hex.models.families import EXECUTION_FIELDS, PRECISION_FIELDS
from jaxrl_hex.models.hf import hf_model_config
from jaxrl_hex.models.model_dir import resolve_model_dir
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.rl.objectives import validate_algo
from jaxrl_hex.sync import METHODS, TRANSPORTS
from jaxrl_hex.tasks import load_task

# JAX's persistent compilation cache, on in every runtime: the train pool's preflight compiles the
# very programs the trainer then runs (a real model's update compiles for minutes on TPU/GPU), and
# resumed runs and replaced Ray workers compile what their predecessors did. JAX_COMPILATION_CACHE_DIR
# names another directory ("" turns it off). Every program is kept, not only those compiling for
# over JAX's default second: a small model's engine and trainer are dozens of quicker compiles,
# which every restart paid again. JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS sets another threshold.
COMPILE_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jaxrl_hex", "xla")

BATCHES = (("train", "rollout.prompts_per_step x rollout.group_size"),
           ("rollout", "rollout.prompts_per_step x rollout.group_size"), ("train", "sft.batch_size"))


@dataclasses.dataclass
class Runtime:
  cfg: typing.Any
  task: typing.Any
  mesh_file: meshes.MeshFile
  policy: Policy
  own_runtime: bool = False  # a Ray worker: its pool is the whole runtime, device ids count from 0
  replica: int | None = None  # a Ray rollout worker: which of the rollout pool's replica_specs() it is
  _pools: dict = dataclasses.field(default_factory=dict)

  @property
  def tokenizer(self):
    return self.task.tokenizer

  def pool(self, role: str) -> meshes.Pool:
    if role not in self._pools:
      spec = self.mesh_file.pools[role]
      if role == "rollout" and self.replica is not None:  # its replica group's own layout and devices
        spec = spec.replica_specs()[self.replica]
      elif self.own_runtime:
        spec = dataclasses.replace(spec, device_ids=tuple(range(len(spec.device_ids))))
      pool = meshes.Pool(spec)
      if role == "train":  # before any weight lands on it: a step XLA says does not fit is refused now
        footprint.preflight(self.cfg, self.policy, pool)
      self._pools[role] = pool
    return self._pools[role]

  @property
  def pools(self) -> dict:
    return {role: self.pool(role) for role in self.mesh_file.pools}

  def shardings(self, role: str):
    """The policy's params laid out on `role`'s pool."""
    return self.pool(role).shardings_for(self.policy.logical_axes(), self.policy.shapes())


def validate(cfg, mesh_file=None, tokenizer=None, policy=None):
  """Every config check that needs no devices; raises ConfigError with a one-line fix. `policy`:
  the model built from cfg.model, if the caller has it (else built here when replica layouts need it)."""
  validate_fields(cfg, tokenizer)
  try:
    validate_algo(cfg)
  except UserError as e:
    raise ConfigError(str(e)) from None
  if cfg.sync.method not in METHODS:
    raise ConfigError(f"sync.method={cfg.sync.method!r}; use one of {METHODS}")
  if cfg.sync.transport not in TRANSPORTS:
    raise ConfigError(f"sync.transport={cfg.sync.transport!r}; use one of {TRANSPORTS}")
  if mesh_file is None:
    return
  for role in ("train", "rollout"):
    if role not in mesh_file.pools:
      raise ConfigError(f"{mesh_file.path}: no '{role}' pool; add pools.{role} with devices and mesh")
  r = cfg.rollout
  # A plan's workload is the run's unless the user set the field (commands._main); name such overrides.
  plan = mesh_file.workload or {}
  overrides = [
      f"rollout.{field}={value} overrides the plan's {plan[key]}"
      for key, field, value in (("batch_size", "prompts_per_step", r.prompts_per_step),
                                ("group_size", "group_size", r.group_size)) if key in plan and plan[key] != value
  ]
  note = f"{', '.join(overrides)} in {mesh_file.path}: drop the override or " if overrides else ""
  sizes = _batch_sizes(cfg)
  for role, field in BATCHES:
    spec = mesh_file.pools[role]
    if spec.groups:  # each replica group has its own layout and share, checked below
      continue
    ways = spec.batch_ways
    if sizes[field] % ways:
      fix = f"pick a multiple of {ways}"
      if field.startswith("rollout."):
        fix = (f"{note}{fix} (rollout.prompts_per_step a multiple of {ways // math.gcd(ways, r.group_size)} at "
               f"group_size {r.group_size})")
      raise ConfigError(f"{field} = {sizes[field]} does not divide the {role} pool's batch axes ({ways} ways); {fix}")
  rollout = mesh_file.pools["rollout"]
  if rollout.groups:
    if mesh_file.workload is not None:  # a plan's shares are whole prompts; hand-written ones are the router's prior
      meshes.check_replica_shares(mesh_file.path, rollout, r.prompts_per_step, r.group_size, note)
    m = cfg.model
    if policy is None:
      try:  # the architecture as far as the config knows it (vocab_size 0 = the tokenizer's: not yet known)
        policy = Policy.build(model_config(**m)) if m.vocab_size > 0 else None
      except (ValueError, TypeError):
        policy = None  # build_runtime reports a bad model config
    if policy is not None:
      degrees = [t for t in (1, 2, 4, 8, 16) if not any(d % t for d in _split_dims(m).values())]
      meshes.check_replica_layouts(
          mesh_file.path, rollout, policy.logical_axes(), policy.shapes(),
          f"use a tensor degree that divides the model's {m.n_heads} heads, {m.n_kv_heads} KV heads, MLP "
          f"{m.mlp_dim} and vocab {m.vocab_size}: one of {degrees}")


def _batch_sizes(cfg) -> dict:
  """BATCHES' field -> its size."""
  r = cfg.rollout
  return {
      "rollout.prompts_per_step x rollout.group_size": r.prompts_per_step * r.group_size,
      "sft.batch_size": cfg.sft.batch_size
  }


def _split_dims(m) -> dict:
  """The model's dims the tensor axis splits (DEFAULT_RULES), by what a message calls them."""
  return {"heads": m.n_heads, "KV heads": m.n_kv_heads, "MLP width": m.mlp_dim, "vocab": m.vocab_size}


def load_mesh(cfg) -> meshes.MeshFile:
  return meshes.load_mesh_file(resolve_path(cfg.mesh_file))


def _unshardable(spec: meshes.PoolSpec, policy) -> str | None:
  """Why `spec` cannot hold the policy's params, or None."""
  try:
    spec.check_shardable(policy.logical_axes(), policy.shapes())
  except meshes.MeshError as e:
    return str(e).removeprefix(f"pools.{spec.name}: ").split("; ")[0]
  return None


def _fits(spec: meshes.PoolSpec, policy, sizes: dict) -> bool:
  """The pool shards the policy and its batch axes divide the batches it runs."""
  batches = [sizes[field] for role, field in BATCHES if role == spec.name]
  return _unshardable(spec, policy) is None and not any(b % spec.batch_ways for b in batches)


def fit_mesh(cfg, mesh_file: meshes.MeshFile, policy, quiet: bool = False) -> meshes.MeshFile:
  """The mesh file with every pool able to shard the policy. The default file (config.DEFAULT_MESH_FILE)
  lays a pool whose tensor axis cannot split the model's dims out again on the same devices
  (meshes.relayouts) and says so in one line on stderr unless `quiet`; a file the user named is refused
  in one line naming a layout, or a shipped file, that works."""
  sizes, pools, moved = _batch_sizes(cfg), dict(mesh_file.pools), []
  for role, spec in mesh_file.pools.items():
    why = None if spec.groups else _unshardable(spec, policy)  # replica groups: validate's own check
    if why is None:
      continue
    tensor = spec.axes.get("tensor", 1)
    split = [f"{n} {name}" for name, n in _split_dims(policy.cfg).items() if n % tensor]
    why = f"tensor {tensor} does not divide the model's {' and '.join(split)}" if split else why
    layouts = [s for s in meshes.relayouts(spec) if _fits(s, policy, sizes)]
    if layouts and cfg.mesh_file == DEFAULT_MESH_FILE:
      pools[role] = layouts[0]
      moved.append((f"{role} on {meshes.format_axes(layouts[0].axes)}", why))
      continue
    raise meshes.MeshError(f"{mesh_file.path}: pools.{role} (mesh {meshes.format_axes(spec.axes)}) cannot shard the "
                           f"model: {why}; {_layout_fix(mesh_file, role, layouts, policy, sizes)}")
  if moved and not quiet:
    whys = "; ".join(dict.fromkeys(why for _, why in moved))
    print(
        f"jaxrl-hex: {mesh_file.path}: {whys}; running {' and '.join(pool for pool, _ in moved)} instead (name "
        "a layout with --config.mesh_file)", file=sys.stderr, flush=True)
  return dataclasses.replace(mesh_file, pools=pools)


def _layout_fix(mesh_file, role, layouts, policy, sizes) -> str:
  """What to run instead: a shipped mesh file whose pools all fit, and a layout of the pool's own devices."""
  fixes = [f"give pools.{role}.mesh {meshes.format_axes(layouts[0].axes)}"] if layouts else []
  for path, other in meshes.shipped_mesh_files(mesh_file.platform):
    if all(_fits(s, policy, sizes) for s in other.pools.values()):
      fixes.insert(0, f"use --config.mesh_file={path}")
      break
  if fixes:
    return ", or ".join(fixes)
  degrees = [t for t in (1, 2, 4, 8, 16) if not any(d % t for d in _split_dims(policy.cfg).values())]
  return (f"no layout of its {len(mesh_file.pools[role].device_ids)} devices shards it and divides this batch: give "
          f"pools.{role} a tensor degree in {degrees} and batch axes that divide the batch (one device always does)")


def resolve_auto(cfg, auto: dict, platform: str) -> str:
  """The model fields a run config left "auto" (`auto`: field -> "auto", read before cfg.model was
  rebuilt from model_dir) set in cfg.model for this model and platform -> a line saying what was
  chosen and why, or "" where the choices are the model's plain defaults (the built-in demo)."""
  m, chosen = cfg.model, {}
  if "dtype" in auto:
    dtype = auto_dtype(platform)
    chosen["dtype"] = (dtype, "on CPU bfloat16 computes slower"
                       if dtype == "float32" else f"compute on {platform}; the master weights stay {m.param_dtype}")
  if "scan_layers" in auto:
    scan = auto_scan_layers(m.n_layers)
    chosen["scan_layers"] = (scan, f"{m.n_layers} layers, " +
                             ("one scanned layer compiles instead of all" if scan else "unrolled"))
  with cfg.unlocked(), m.ignore_type():
    for field, (value, _) in chosen.items():
      m[field] = value
  if all(value == DEFAULTS[field] for field, (value, _) in chosen.items()):
    return ""
  return "model settings chosen for this model and platform: " + ", ".join(
      f"model.{field}={value!r} ({why})" for field, (value, why) in chosen.items())


def _platform(mesh_file: meshes.MeshFile) -> str:
  """What the pools compute on: the file's platform, this runtime's for `any` (`mixed` pools are accelerators)."""
  if mesh_file.platform == "any":
    return jax.default_backend()
  return "accelerators" if mesh_file.platform == "mixed" else mesh_file.platform


def enable_compile_cache():
  """Points JAX's persistent compilation cache at COMPILE_CACHE_DIR unless the environment names
  one, keeping every program. JAX decides at its first compile whether a process uses the cache,
  so this comes first."""
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ and jax.config.jax_compilation_cache_dir is None:
    jax.config.update("jax_compilation_cache_dir", COMPILE_CACHE_DIR)
  threshold = "jax_persistent_cache_min_compile_time_secs"
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ and getattr(jax.config, threshold) == 1.0:
    jax.config.update(threshold, 0.0)  # JAX's default; one the process set itself stands


def build_runtime(cfg, own_runtime=False, replica=None, check_prompts=True) -> Runtime:
  """replica: a Ray rollout worker's index into the rollout pool's replica_specs() (its layout).
  check_prompts: the task's prompts against rollout.max_prompt_len (generate brings its own)."""
  enable_compile_cache()
  mesh_file = load_mesh(cfg)
  validate_fields(cfg)  # before the task and the model load (seconds for a real one); validate() repeats it
  auto = {k: AUTO for k in AUTO_FIELDS if cfg.model[k] == AUTO}  # chosen below, for the model and platform
  if cfg.get("model_dir"):  # the architecture is the checkpoint's config.json; precision, execution
    # (remat, scan, attention and logprob blocking) and the adapters on the model stay the run's
    with cfg.unlocked():
      own = {k: cfg.model[k] for k in PRECISION_FIELDS + EXECUTION_FIELDS if k in cfg.model and k not in auto}
      cfg.model = hf_model_config(resolve_model_dir(cfg.model_dir), lora=cfg.model.lora.to_dict(), **own)
  task = load_task(cfg.task, cfg, check_prompts)
  if cfg.model.vocab_size == 0:  # "auto": the task tokenizer's size, rounded up so it shards
    with cfg.unlocked():
      cfg.model.vocab_size = -(-task.tokenizer.vocab_size // 8) * 8
  chosen = resolve_auto(cfg, auto, _platform(mesh_file))
  if chosen and not own_runtime:  # a Ray worker's config comes resolved from the driver
    print(f"jaxrl-hex: {chosen}", file=sys.stderr, flush=True)
  try:
    policy = Policy.build(model_config(**cfg.model))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  mesh_file = fit_mesh(cfg, mesh_file, policy, quiet=own_runtime)  # a parameter that cannot shard fails here
  validate(cfg, mesh_file, task.tokenizer, policy)  # checks every replica group's layout too
  return Runtime(cfg, task, mesh_file, policy, own_runtime, replica)
