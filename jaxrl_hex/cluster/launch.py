"""jaxrl-hex launch tpu|ray ... -- COMMAND: run a jaxrl-hex command on a TPU VM pod slice or an
existing Ray cluster.

  jaxrl-hex launch tpu --name my-slice --zone us-east5-a --accelerator-type v5p-32 [--dry-run] -- train ...
  jaxrl-hex launch ray --address http://HEAD:8265 [--dry-run] -- train --config.cluster.backend=ray ...

On a pod slice every worker runs the same command and JAX finds its peers by itself
(jax.distributed.initialize() reads the TPU metadata), so the command is the same on each.
"""
import argparse
import shlex
import subprocess

from jaxrl_hex import arguments
from jaxrl_hex.errors import UserError

# chips per host of multi-host slices ("v5litepod" is v5e's accelerator-type name)
CHIPS_PER_HOST = {"v4": 4, "v5p": 4, "v5litepod": 4, "v5e": 4, "v6e": 4}
CORES_PER_CHIP = {"v4": 2, "v5p": 2}  # their type names count TensorCores, not chips


def tpu_hosts(accelerator_type: str) -> int:
  """'v5p-32' -> 4 hosts. Single-host types (e.g. v6e-8, v5litepod-8) give 1."""
  try:
    family, count = accelerator_type.rsplit("-", 1)
    chips = int(count) // CORES_PER_CHIP.get(family, 1)
    per_host = CHIPS_PER_HOST[family]
  except (ValueError, KeyError):
    raise UserError(f"--accelerator-type {accelerator_type!r}: expected FAMILY-COUNT with FAMILY in "
                    f"{sorted(CHIPS_PER_HOST)}, e.g. v5p-32 or v6e-16") from None
  if chips <= 8 and family in ("v5litepod", "v5e", "v6e"):
    return 1  # single-host slices carry up to 8 chips
  return max(1, chips // per_host)


def tpu_commands(name, zone, accelerator_type, project, command, repo_dir) -> list[list[str]]:
  """One gcloud ssh per worker of the slice, each running the same jaxrl-hex command."""
  remote = f"cd {repo_dir} && JAXRL_HEX_MULTIHOST=1 jaxrl-hex {shlex.join(command)}"  # unquoted: ~ must expand there
  base = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", name, f"--zone={zone}"]
  if project:
    base.append(f"--project={project}")
  return [base + [f"--worker={w}", f"--command={remote}"] for w in range(tpu_hosts(accelerator_type))]


def ray_command(address, command, working_dir) -> list[str]:
  return ["ray", "job", "submit", f"--address={address}", f"--working-dir={working_dir}", "--", "jaxrl-hex", *command]


def _parser():
  parser = arguments.Parser("jaxrl-hex launch", __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="target", required=True, metavar="{tpu,ray}")
  tpu = sub.add_parser("tpu", help="every worker of a TPU VM pod slice, over gcloud ssh")
  tpu.add_argument("--name", required=True, help="the TPU VM (pod slice) name")
  tpu.add_argument("--zone", required=True, help="its zone, e.g. us-east5-a")
  tpu.add_argument("--accelerator-type", required=True, help="its type, e.g. v5p-32: the number of workers follows")
  tpu.add_argument("--project", default="", help="Google Cloud project (default: gcloud's)")
  tpu.add_argument("--repo-dir", default="~/jaxrl_hex", help="where the repository is on the workers")
  tpu.add_argument("--dry-run", action="store_true", help="print the gcloud commands instead of running them")
  ray = sub.add_parser("ray", help="an existing Ray cluster, as a Ray job")
  ray.add_argument("--address", required=True, help="the Ray dashboard / jobs address, e.g. http://HEAD:8265")
  ray.add_argument("--working-dir", default=".", help="directory uploaded as the job's working directory")
  ray.add_argument("--dry-run", action="store_true", help="print the ray job submit command instead of running it")
  # `launch --help` shows both targets' flags: they are what a user needs, not just the target names
  parser.epilog = "\n\n".join(f"launch {name}:\n" + _indent(p.format_help()) for name, p in sub.choices.items())
  return parser


def _indent(text: str) -> str:
  return "\n".join(f"  {line}".rstrip() for line in text.splitlines())


def _launch(args, command) -> int:
  if args.target == "tpu":
    commands = tpu_commands(args.name, args.zone, args.accelerator_type, args.project, command, args.repo_dir)
  else:
    commands = [ray_command(args.address, command, args.working_dir)]
  if args.dry_run:
    for c in commands:
      print(shlex.join(c))
    return 0
  procs = [subprocess.Popen(c) for c in commands]  # the workers run together, not one after another
  return max(p.wait() for p in procs)


def main(argv) -> int:
  split = argv.index("--") if "--" in argv else len(argv)
  if split == len(argv) and not {"-h", "--help"} & set(argv):
    return arguments.fail("launch needs `-- COMMAND`, e.g. launch tpu ... -- train --config=...")
  return arguments.run(_parser(), lambda args: _launch(args, argv[split + 1:]), argv[:split])
