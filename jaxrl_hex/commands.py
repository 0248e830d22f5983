"""The train and sft commands: read the config and its overrides, build the runtime and the pools'
sides, run, summarise.

  jaxrl-hex train --config=configs/arith_grpo.py --config.train.steps=200 --workdir=runs/a
  jaxrl-hex train --workdir=runs/a --resume
"""
import contextlib
import json
import os
import signal
import sys
import threading
import time

import jax
import ml_collections
from absl import logging as absl_logging

from jaxrl_hex import arguments
from jaxrl_hex.base_weights import check_base_source, first_weights
from jaxrl_hex.checkpoint import Checkpointer, CheckpointError
from jaxrl_hex.cluster import build_sides, check_config
from jaxrl_hex.config import (
    apply_overrides,
    base_config,
    load_config_file,
    read_run_config,
    write_run_config,
)
from jaxrl_hex.errors import UserError
from jaxrl_hex.gin_config import apply_gin
from jaxrl_hex.meshes import prepare_cpu_devices
from jaxrl_hex.metrics import Recorder
from jaxrl_hex.models.families import EXECUTION_FIELDS
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
  """Checks the workdir against --resume; a new run's config.json is written here, a resumed
  one's only once its state restored (a resume that fails leaves the run as it was)."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise UserError(f"--workdir={workdir} is a file; pass a directory (it is created if missing)")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  latest = Checkpointer(ckpt_dir).latest_step() if os.path.isdir(ckpt_dir) else None
  if resume and latest is None:
    raise CheckpointError(f"--resume: {workdir} has no checkpoint to resume from; drop --resume to start a new run")
  if not resume and latest is not None:
    raise CheckpointError(f"{workdir} already holds a run; pass --resume to continue it or pick another --workdir")
  step = cfg.train.get("resume_step", -1)
  if resume and (latest if step < 0 else step) >= cfg.train.steps:
    raise UserError(f"--resume: the run in {workdir} is done (checkpoint {latest if step < 0 else step}, "
                    f"train.steps={cfg.train.steps}); raise --config.train.steps to train on")
  try:
    os.makedirs(workdir, exist_ok=True)
    if not os.access(workdir, os.W_OK):
      raise PermissionError(workdir)
  except OSError as e:
    raise UserError(f"--workdir={workdir} is not writable ({type(e).__name__}); pick a directory you can "
                    "write") from None
  if not resume:
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
  t0 = time.time()
  check_base_source(cfg)  # before the runtime: it reads the task and builds the model
  rt = build_runtime(cfg)
  ckpt_dir = _prepare_workdir(cfg, workdir, resume=False)
  recorder = Recorder(workdir, config=cfg)
  params, _ = first_weights(rt, workdir, False, recorder, warm_start=False)
  checkpointer = Checkpointer(ckpt_dir, cfg.train.keep_checkpoints)
  _, summary = run_sft(rt, params, recorder, checkpointer)
  checkpointer.close()
  recorder.close()
  summary["wall_seconds"] = time.time() - t0
  write_summary(workdir, summary)
  return summary


def write_summary(workdir, summary):
  """summary.json: a finished run's closing figures (steps, held-out accuracy before and after, seconds)."""
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)


def closing_line(name, summary) -> str:
  """The held-out accuracy a command started and ended at, naming where each was measured."""
  end = summary["eval_accuracy_end"]
  if name == "sft":
    start, where = summary["eval_accuracy_start"], f"start -> end of SFT, {summary['steps']} steps"
  elif summary.get("warmstart"):
    start, where = summary["warmstart"]["eval_accuracy_end"], "warm start -> end of RL"
  elif summary.get("resumed_from") is not None:
    start, where = summary["eval_accuracy_start"], f"resumed at step {summary['resumed_from']} -> end of RL"
  else:
    start, where = summary["eval_accuracy_start"], "start of RL -> end of RL"
  return f"held-out accuracy {start:.3f} -> {end:.3f} ({where}), wall time {summary['wall_seconds']:.0f}s"


def train(cfg, workdir, resume=False):
  t0 = time.time()
  rt = build_runtime(cfg)
  check_config(cfg)
  _prepare_workdir(cfg, workdir, resume)
  recorder = Recorder(workdir, append=resume, config=cfg)
  train_side, rollout_side = build_sides(rt, workdir, resume, recorder)
  resumed_from = train_side.version if resume else None
  if resume:  # restored: the resumed run's config and metrics from the checkpoint's step on
    write_run_config(cfg, workdir)
    recorder.resume_at(resumed_from)
  try:
    write_cluster(workdir, train_side, rollout_side)
    rollout_side.on_restart = lambda: write_cluster(workdir, train_side, rollout_side)
    orchestrator = Orchestrator(rt, train_side, rollout_side, recorder)
    with stop_on_signals(orchestrator.request_stop, cfg.train.stop_deadline_s):
      summary = orchestrator.run()
  finally:
    train_side.close()
    rollout_side.close()
    recorder.close()
  summary["warmstart"] = train_side.warmstart
  summary["resumed_from"] = resumed_from
  summary["wall_seconds"] = time.time() - t0
  write_summary(workdir, summary)
  return summary


@contextlib.contextmanager
def stop_on_signals(request_stop, deadline_s: float):
  """SIGTERM (a preempted TPU or spot VM) and SIGINT ask the run to checkpoint and stop
  (request_stop). If it has not stopped `deadline_s` later, or on a second signal, the process
  ends at once with exit status 3: --resume then continues from the last checkpoint written."""
  if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
    yield
    return

  def abandon(name):
    print(
        f"jaxrl-hex: error: {name}: the run did not checkpoint within train.stop_deadline_s={deadline_s:g}; "
        "--resume continues from its last checkpoint", file=sys.stderr, flush=True)
    os._exit(3)

  def handle(signum, _frame):
    name = signal.Signals(signum).name
    if timers:
      abandon(name)
    request_stop(name)
    timers.append(threading.Timer(deadline_s, abandon, (name,)))
    timers[-1].daemon = True
    timers[-1].start()

  timers = []
  previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield
  finally:
    for timer in timers:
      timer.cancel()
    for sig, old in previous.items():
      signal.signal(sig, old)


def parser(name: str) -> arguments.Parser:
  """The flags of train and sft; --config.SECTION.FIELD=VALUE overrides come on top."""
  fields = base_config()
  sections = [k for k, v in fields.items() if isinstance(v, ml_collections.ConfigDict)]
  epilog = (f"config sections (--config.SECTION.FIELD=VALUE): {', '.join(sections)}; top-level fields: "
            f"{', '.join(k for k in fields if k not in sections)}. Every field with its default and meaning: "
            "docs/cli.md (python docs/gen_cli.py writes it).")
  p = arguments.Parser(f"jaxrl-hex {name}", DESCRIPTIONS[name], epilog=epilog)
  p.add_argument("--config", default=None,
                 help=f"config file whose get_config() returns the run config (default {DEFAULT_CONFIG})")
  p.add_argument("--workdir", default=None, help="run directory (default runs/<command>-<time>)")
  p.add_argument(
      "--resume", action="store_true",
      help="continue the run in --workdir from its last intact checkpoint, with its saved config.json "
      "and the --config.* flags given here on top")
  if name == "train":
    p.add_argument(
        "--step", type=int, default=None,
        help="with --resume: the checkpoint step to continue from (later ones move to "
        "checkpoints/superseded/)")
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

# What a resumed run cannot change: its checkpoint's shapes (model.*, but how the step runs and
# computes) and its data and sampling streams.
RESUME_FIXED = ("model", "task", "task_args", "seed")
RESUME_FREE = set(EXECUTION_FIELDS) | {"dtype"}


def _resume_config(args, overrides, use_gin):
  """The run's saved config.json with this command line's --config.* flags (and gin) on top."""
  if args.config is not None:
    raise UserError(f"--resume continues {args.workdir} with its saved config.json; drop --config={args.config} "
                    "and set the fields to change with --config.SECTION.FIELD=VALUE")
  if not os.path.isfile(os.path.join(args.workdir, "config.json")):
    raise CheckpointError(f"--resume: {args.workdir} has no run to resume from (no config.json); drop --resume to "
                          "start a new run")
  cfg = read_run_config(args.workdir, "--resume --workdir")
  saved = cfg.to_dict()
  apply_overrides(cfg, overrides)
  if use_gin:
    apply_gin(cfg, args.gin_file, args.gin_bindings)
  for section in RESUME_FIXED:
    now, was = cfg.to_dict()[section], saved[section]
    if not isinstance(now, dict):
      now, was = {"": now}, {"": was}
    for key in sorted(set(now) | set(was)):
      if key not in RESUME_FREE and now.get(key) != was.get(key):
        field = f"{section}.{key}" if key else section
        raise UserError(f"--config.{field}={now.get(key)!r}: {field} cannot change on resume (the run was saved "
                        f"with {was.get(key)!r}); drop the flag, or start a new run in another --workdir")
  cfg.train.resume_step = -1 if args.step is None else args.step
  return cfg


def _main(name, args, unparsed):
  overrides = config_overrides(unparsed)
  use_gin = bool(args.gin_file or args.gin_bindings)
  if args.resume and not args.workdir:
    raise UserError("--resume needs --workdir=DIR, the run to continue")
  if getattr(args, "step", None) is not None and not args.resume:
    raise UserError(f"--step={args.step} picks the checkpoint --resume continues from; add --resume")
  if args.resume and name == "train":
    cfg = _resume_config(args, overrides, use_gin)
    mesh_file = load_mesh(cfg)
  else:
    cfg = _new_config(args, overrides, use_gin)
    mesh_file = load_mesh(cfg)
    _apply_plan(cfg, mesh_file, overrides, args, use_gin)
  cfg.lock()  # fields can change, none can appear: a typo in code fails like one on the command line
  if name == "train":  # the backend against the mesh file (replica groups need Ray) before any device is touched
    check_config(cfg, mesh_file)
  workdir = args.workdir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
  absl_logging.set_verbosity(absl_logging.WARNING)
  if os.environ.get("JAXRL_HEX_MULTIHOST"):  # set by `launch tpu`: the slice's hosts form one runtime
    jax.distributed.initialize()
  if mesh_file.platform == "cpu" and mesh_file.num_devices:
    prepare_cpu_devices(mesh_file.num_devices)
  summary = (train if name == "train" else sft)(cfg, workdir, resume=args.resume)
  if summary.get("eval_accuracy_end") is not None and summary.get("eval_accuracy_start") is not None:
    print(closing_line(name, summary))
  print(f"workdir: {workdir}")


def _new_config(args, overrides, use_gin):
  cfg = load_config_file(DEFAULT_CONFIG if args.config is None else args.config)
  apply_overrides(cfg, overrides)
  if use_gin:  # gin binds onto the same ConfigDict, after the --config.* overrides (it may name the mesh file)
    apply_gin(cfg, args.gin_file, args.gin_bindings)
  return cfg


def _apply_plan(cfg, mesh_file, overrides, args, use_gin):
  """A plan's batch, remat, micro-batch and LoRA adapters become the run's, unless the user set the
  field (runtime.validate names it). A resumed run has them in its saved config already."""
  plan = {f"rollout.{field}": mesh_file.workload[key] for key, field in PLAN_WORKLOAD if mesh_file.workload}
  plan.update(mesh_file.train_knobs)
  overridden = {k for k, _ in overrides}
  for field, value in plan.items():
    if field not in overridden:
      *sections, key = field.split(".")
      node = cfg
      for section in sections:
        node = node[section]
      node[key] = value
  if plan and use_gin:  # gin bindings win over the plan too
    apply_gin(cfg, args.gin_file, args.gin_bindings)


def train_main(argv) -> int:
  return arguments.run(parser("train"), lambda args, unparsed: _main("train", args, unparsed), argv, extras=True)


def sft_main(argv) -> int:
  return arguments.run(parser("sft"), lambda args, unparsed: _main("sft", args, unparsed), argv, extras=True)
