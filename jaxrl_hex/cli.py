"""jaxrl-hex COMMAND [flags]. Config commands take --config=FILE.py --config.a.b=value --workdir=DIR."""
import os
import sys
import time

USAGE = """usage: jaxrl-hex COMMAND [flags]

commands:
  train     async RL (GRPO) on the train/rollout pools of a mesh file; warm-starts by SFT
            unless --config.init_from names a workdir
  sft       supervised training on a task's answers
  plan      heterogeneity-aware split of a cluster into train and rollout pools
  simulate  discrete-event simulation of a plan's async loop
  generate  sample from a run's checkpoint for a JSONL file of prompts (continuous batching)
  report    figures and a markdown summary of runs: jaxrl-hex report WORKDIR [WORKDIR...]
  launch    run a command on every worker of a TPU pod slice, or as a job on a Ray cluster
  convert   Hugging Face model dir <-> Orbax run: --from-hf=DIR --out=RUN | --to-hf=RUN --out=DIR

  jaxrl-hex train --config=configs/arith_grpo.py --config.train.steps=200 --workdir=runs/demo
  jaxrl-hex train --workdir=runs/demo --resume
"""
DEFAULT_CONFIG = "configs/arith_grpo.py"


def _fail(msg: str) -> int:
  print(f"jaxrl-hex: error: {msg}", file=sys.stderr)
  return 2


def _config_command(name: str, argv: list[str]) -> int:
  from absl import flags, logging as absl_logging

  from jaxrl_hex.config import resolve_path
  from jaxrl_hex.errors import RunStopped, UserError

  argv = ["jaxrl-hex " + name] + [
      "--config=" + resolve_path(arg[len("--config="):]) if arg.startswith("--config=") else arg for arg in argv
  ]
  try:
    fv = config_flag_values(argv)
    fv(argv)
  except (flags.Error, KeyError, AttributeError, FileNotFoundError) as e:
    return _fail(_flag_message(e, argv))
  cfg = fv.config
  if fv.resume and not fv.workdir:
    return _fail("--resume needs --workdir=DIR, the run to continue")
  workdir = fv.workdir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
  absl_logging.set_verbosity(absl_logging.WARNING)
  try:
    if fv.gin_file or fv.gin_bindings:  # gin binds onto the same ConfigDict, after the --config.* overrides
      from jaxrl_hex.gin_config import apply_gin
      apply_gin(cfg, fv.gin_file, fv.gin_bindings)
    from jaxrl_hex.runtime import load_mesh
    if os.environ.get("JAXRL_HEX_MULTIHOST"):  # set by `launch tpu`: the slice's hosts form one runtime
      import jax
      jax.distributed.initialize()
    mesh_file = load_mesh(cfg)
    if mesh_file.platform == "cpu" and mesh_file.num_devices:
      from jaxrl_hex.meshes import prepare_cpu_devices
      prepare_cpu_devices(mesh_file.num_devices)
    from jaxrl_hex import commands
    summary = getattr(commands, name)(cfg, workdir, resume=fv.resume)
  except UserError as e:
    return _fail(str(e))
  except RunStopped as e:
    _fail(str(e))
    return 3
  if summary.get("wall_seconds") is not None and summary.get("eval_accuracy_end") is not None:
    warm = summary.get("warmstart") or {}
    before = warm.get("eval_accuracy_end", summary["eval_accuracy_start"])
    print(f"held-out accuracy {before:.3f} -> {summary['eval_accuracy_end']:.3f} "
          f"(warm start -> end of RL), wall time {summary['wall_seconds']:.0f}s")
  print(f"workdir: {workdir}")
  return 0 if summary is not None else 1


def config_flag_values(argv):
  """The flags of train and sft (docs/gen_cli.py documents them from here)."""
  from absl import flags
  from ml_collections import config_flags

  from jaxrl_hex.config import resolve_path
  fv = flags.FlagValues()
  # sys_argv: overrides are read from these args, not from the process's sys.argv
  config_flags.DEFINE_config_file("config", resolve_path(DEFAULT_CONFIG), "config file (get_config())", flag_values=fv,
                                  lock_config=True, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "run directory (default runs/<command>-<time>)", flag_values=fv)
  flags.DEFINE_bool("resume", False, "continue the run in --workdir from its last checkpoint", flag_values=fv)
  flags.DEFINE_multi_string("gin_file", [], "gin file binding config fields (SECTION.FIELD = VALUE); repeatable",
                            flag_values=fv)
  flags.DEFINE_multi_string("gin_bindings", [], "one gin binding, e.g. 'rollout.temperature = 0.7'; repeatable",
                            flag_values=fv)
  return fv


def _flag_message(e, argv) -> str:
  """An unknown --config.key names the keys that exist; anything else keeps the flag's own words."""
  from jaxrl_hex.config import load_config_file, unknown_key_message
  path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), DEFAULT_CONFIG)
  try:
    cfg = load_config_file(path)
  except FileNotFoundError:
    return f"--config: {path!r} does not exist; pass a config file such as {DEFAULT_CONFIG}"
  for arg in argv:
    if arg.startswith("--config."):
      key = arg[len("--config."):].split("=", 1)[0]
      node = cfg
      for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
          return unknown_key_message(cfg, key)
        node = node[part]
  return str(e).strip().splitlines()[0]


# Commands with their own argument parsing: name -> "module:function(argv) -> exit code".
COMMANDS = {
    "plan": "jaxrl_hex.planner.command:plan_main",
    "simulate": "jaxrl_hex.planner.command:simulate_main",
    "launch": "jaxrl_hex.cluster.launch:main",
    "report": "jaxrl_hex.report:main",
    "generate": "jaxrl_hex.rollout.generate:main",
    "convert": "jaxrl_hex.convert:main",
}
CONFIG_COMMANDS = ("train", "sft")


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(USAGE)
    return 0
  name, rest = argv[0], argv[1:]
  if name in CONFIG_COMMANDS:
    return _config_command(name, rest)
  if name in COMMANDS:
    import importlib
    module, fn = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module), fn)(rest)
  return _fail(f"unknown command {name!r}; commands: {', '.join([*CONFIG_COMMANDS, *COMMANDS])}")


if __name__ == "__main__":
  sys.exit(main())
