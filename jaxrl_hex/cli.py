"""jaxrl-hex COMMAND [flags]: one entry point. Every command is a module's main(argv) -> exit code
built on jaxrl_hex/arguments.py (argparse), so help, errors and exit codes are alike everywhere."""
import importlib
import sys

from jaxrl_hex import __version__
from jaxrl_hex.arguments import fail
from jaxrl_hex.errors import UserError
from jaxrl_hex.host_memory import restart_with_tunables

USAGE = """usage: jaxrl-hex COMMAND [flags]      (jaxrl-hex COMMAND --help for its flags)

commands:
  train     async RL (GRPO) on the train/rollout pools of a mesh file; warm-starts by SFT
            unless --config.init_from names a workdir
  sft       supervised training on a task's answers
  plan      heterogeneity-aware split of a cluster into train and rollout pools
  simulate  discrete-event simulation of a plan's async loop
  calibrate fit the planner's cost model to runs on your cluster: WORKDIR... --out fitted.yaml
  generate  sample from a run's checkpoint for a JSONL file of prompts (continuous batching)
  eval      held-out accuracy of a run's checkpoint (--step=N|best) or a Hugging Face model dir:
            greedy, and pass@k / mean@k with --samples=k
  report    figures and a markdown summary of runs: jaxrl-hex report WORKDIR [WORKDIR...]
  launch    run a command on every worker of a TPU pod slice, or as a job on a Ray cluster
  convert   Hugging Face model dir <-> Orbax run: --from-hf=DIR --out=RUN | --to-hf=RUN --out=DIR;
            LoRA adapters as PEFT: --to-peft=RUN --out=DIR | --from-peft=DIR --base=MODEL_DIR --out=RUN

exit codes: 0 done, 2 bad input (one line naming the field and the fix), 3 a run stopped that
--resume continues

  jaxrl-hex train --config=configs/arith_grpo.py --config.train.steps=200 --workdir=runs/demo
  jaxrl-hex train --workdir=runs/demo --resume
"""

# name -> "module:function(argv) -> exit code"; imported on use, so `plan` never loads JAX
COMMANDS = {
    "train": "jaxrl_hex.commands:train_main",
    "sft": "jaxrl_hex.commands:sft_main",
    "plan": "jaxrl_hex.planner.command:plan_main",
    "simulate": "jaxrl_hex.planner.command:simulate_main",
    "calibrate": "jaxrl_hex.calibration:main",
    "generate": "jaxrl_hex.generate:main",
    "eval": "jaxrl_hex.eval_command:main",
    "report": "jaxrl_hex.report:main",
    "launch": "jaxrl_hex.cluster.launch:main",
    "convert": "jaxrl_hex.convert:main",
}


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("-h", "--help", "help"):
    print(USAGE)
    return 0
  if not argv:  # a command is missing: the list, as a usage error
    print(USAGE, file=sys.stderr)
    return 2
  if argv[0] == "--version":
    print(f"jaxrl-hex {__version__}")
    return 0
  name, rest = argv[0], argv[1:]
  if name not in COMMANDS:
    return fail(f"unknown command {name!r}; commands: {', '.join(COMMANDS)}")
  module, fn = COMMANDS[name].split(":")
  return getattr(importlib.import_module(module), fn)(rest)


def entry():
  """The `jaxrl-hex` program: a restart with glibc's tunables first where it started without them
  (host_memory: streaming copies; huge pages under JAXRL_HEX_MALLOC=huge), then the command."""
  try:
    restart_with_tunables()
  except UserError as e:
    sys.exit(fail(str(e)))
  sys.exit(main())


if __name__ == "__main__":
  entry()
