"""The train and sft commands: read the config and its overrides, build the runtime and the pools'
sides, run, summarise.

  jaxrl-hex train --config=configs/arith_grpo.py --config.train.steps=200 --workdir=runs/a
  jaxrl-hex train --workdir=runs/a --resume
"""
import json
import os
import time

import jax
from absl import logging as absl_logging

from jaxrl_hex import arguments
from jaxrl_hex.checkpoint import Checkpointer, CheckpointError
from jaxrl_hex.cluster import build_sides, check_config
from jaxrl_hex.config import apply_overrides, load_config_file, resolve_path, write_run_config
from jaxrl_hex.errors import UserError
from jaxrl_hex.gin_config import apply_gin
from jaxrl_hex.meshes import prepare_cpu_devices
from jaxrl_hex.metrics import Recorder
from jaxrl_hex.models.hf import load_params
from jaxrl_hex.orchestrator import Orchestrator
from jaxrl_hex.runtime import build_runtime, load_mesh
from jaxrl_hex.sft import run_sft

DEFAULT_CONFIG = "configs/arith_grpo.py"
DESCRIPTIONS = {
    "train": "Async RL on the train and rollout pools of a mesh file; warm-starts by SFT unless "
             "--config.init_from names a workdir. Any config field: --config.SECTION.FIELD=VALUE.",
    "sft": "Supervised training on a task's answers. Any config field: --config.SECTION.FIELD=VALUE.",
}


def _prepare_workdir(cfg, workdir, resume):
  ckpt_dir = os.path.join(workdir, "checkpoints")
  has_ckpt = os.path.isdir(ckpt_dir) and Checkpointer(ckpt_dir).latest_step() is not None
  if resume and not has_ckpt:
    raise CheckpointError(f"--resume: {workdir} has no checkpoint to resume from; drop --resume to start a new run")
  if not resume and has_ckpt:
    raise CheckpointError(f"{workdir} already holds a run; pass --resume to continue it or pick another --workdir")
  write_run_config(cfg, workdir)
  return ckpt_dir


def write_cluster(workdir, train, rollout):
  """cluster.json: every pool, its role, hosts, process ids, devices and mesh (rewritten on restarts)."""
  path = os.path.join(workdir, "cluster.json")
  with open(path + ".tmp", "w") as f:
    json.dump({"train": train.describe(), "rollout": rollout.describe()}, f, indent=2)
  os.replace(path + ".tmp", path)


def sft(cfg, workdir, resume=False):
  if resume:
    raise UserError("sft --resume: a supervised run restarts from scratch; drop --resume or use a new --workdir")
  rt = build_runtime(cfg)
  ckpt_dir = _prepare_workdir(cfg, workdir, resume=False)
  recorder = Recorder(workdir, config=cfg)
  params = (load_params(resolve_path(cfg.model_dir), rt.policy.cfg, rt.shardings("train"))
            if cfg.get("model_dir") else rt.policy.init(cfg.seed, rt.shardings("train")))
  checkpointer = Checkpointer(ckpt_dir, cfg.train.keep_checkpoints)
  _, summary = run_sft(rt, params, recorder, checkpointer)
  checkpointer.close()
  recorder.close()
  return summary


def train(cfg, workdir, resume=False):
  t0 = time.time()
  rt = build_runtime(cfg)
  check_config(cfg)
  _prepare_workdir(cfg, workdir, resume)
  recorder = Recorder(workdir, append=resume, config=cfg)
  train_side, rollout_side = build_sides(rt, workdir, resume, recorder)
  try:
    write_cluster(workdir, train_side, rollout_side)
    rollout_side.on_restart = lambda: write_cluster(workdir, train_side, rollout_side)
    summary = Orchestrator(rt, train_side, rollout_side, recorder).run()
  finally:
    train_side.close()
    rollout_side.close()
    recorder.close()
  summary["warmstart"] = train_side.warmstart
  summary["wall_seconds"] = time.time() - t0
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary


def parser(name: str) -> arguments.Parser:
  """The flags of train and sft; --config.SECTION.FIELD=VALUE overrides come on top."""
  p = arguments.Parser(f"jaxrl-hex {name}", DESCRIPTIONS[name])
  p.add_argument("--config", default=DEFAULT_CONFIG, help="config file whose get_config() returns the run config")
  p.add_argument("--workdir", default=None, help="run directory (default runs/<command>-<time>)")
  p.add_argument("--resume", action="store_true", help="continue the run in --workdir from its last checkpoint")
  p.add_argument("--gin_file", action="append", default=[],
                 help="gin file binding config fields (SECTION.FIELD = VALUE); repeatable")
  p.add_argument("--gin_bindings", action="append", default=[],
                 help="one gin binding, e.g. 'rollout.temperature = 0.7'; repeatable")
  return p


def config_overrides(unparsed: list[str]) -> list[tuple[str, str]]:
  """['--config.a.b=1', '--config.c', 'x'] -> [('a.b', '1'), ('c', 'x')]; anything else is an error."""
  out, args = [], list(unparsed)
  while args:
    arg = args.pop(0)
    if not arg.startswith("--config."):
      raise UserError(f"unrecognized argument {arg!r}; config fields are set as --config.SECTION.FIELD=VALUE")
    key, eq, value = arg[len("--config."):].partition("=")
    if not eq:
      if not args:
        raise UserError(f"--config.{key} needs a value: --config.{key}=VALUE")
      value = args.pop(0)
    out.append((key, value))
  return out


PLAN_WORKLOAD = (("batch_size", "prompts_per_step"), ("group_size", "group_size"))  # plan.workload -> rollout.*


def _main(name, args, unparsed):
  cfg = load_config_file(args.config)
  overrides = config_overrides(unparsed)
  apply_overrides(cfg, overrides)
  use_gin = bool(args.gin_file or args.gin_bindings)
  if use_gin:  # gin binds onto the same ConfigDict, after the --config.* overrides (it may name the mesh file)
    apply_gin(cfg, args.gin_file, args.gin_bindings)
  mesh_file = load_mesh(cfg)
  # A plan's batch, remat and micro-batch are the run's, unless the user set the field (runtime.validate names it).
  plan = {f"rollout.{field}": mesh_file.workload[key] for key, field in PLAN_WORKLOAD if mesh_file.workload}
  plan.update(mesh_file.train_knobs)
  overridden = {k for k, _ in overrides}
  for field, value in plan.items():
    if field not in overridden:
      section, key = field.split(".")
      cfg[section][key] = value
  if plan and use_gin:  # gin bindings win over the plan too
    apply_gin(cfg, args.gin_file, args.gin_bindings)
  cfg.lock()  # fields can change, none can appear: a typo in code fails like one on the command line
  if name == "train":  # the backend against the mesh file (replica groups need Ray) before any device is touched
    check_config(cfg, mesh_file)
  if args.resume and not args.workdir:
    raise UserError("--resume needs --workdir=DIR, the run to continue")
  workdir = args.workdir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
  absl_logging.set_verbosity(absl_logging.WARNING)
  if os.environ.get("JAXRL_HEX_MULTIHOST"):  # set by `launch tpu`: the slice's hosts form one runtime
    jax.distributed.initialize()
  if mesh_file.platform == "cpu" and mesh_file.num_devices:
    prepare_cpu_devices(mesh_file.num_devices)
  summary = (train if name == "train" else sft)(cfg, workdir, resume=args.resume)
  if summary.get("wall_seconds") is not None and summary.get("eval_accuracy_end") is not None:
    warm = summary.get("warmstart") or {}
    before = warm.get("eval_accuracy_end", summary["eval_accuracy_start"])
    print(f"held-out accuracy {before:.3f} -> {summary['eval_accuracy_end']:.3f} "
          f"(warm start -> end of RL), wall time {summary['wall_seconds']:.0f}s")
  print(f"workdir: {workdir}")


def train_main(argv) -> int:
  return arguments.run(parser("train"), lambda args, unparsed: _main("train", args, unparsed), argv, extras=True)


def sft_main(argv) -> int:
  return arguments.run(parser("sft"), lambda args, unparsed: _main("sft", args, unparsed), argv, extras=True)
