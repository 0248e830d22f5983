"""What every jaxrl-hex command shares, so help, errors and exit codes are the same everywhere:
an argparse parser whose usage errors are one line, and one runner that maps a command's outcome
to its exit code.

  0  done                     (also --help)
  2  bad input                one line on stderr: `jaxrl-hex: error: ...`, naming the field and the fix
  3  a run stopped            one line saying how to continue it (--resume)
"""
import argparse
import sys

from jaxrl_hex.errors import RunStopped, UserError


class Parser(argparse.ArgumentParser):
  """argparse without abbreviations, whose usage errors are UserErrors (one line, exit 2)."""

  def __init__(self, prog: str, description: str = "", **kwargs):
    super().__init__(prog=prog, description=description, allow_abbrev=False, **kwargs)

  def error(self, message):
    raise UserError(f"{self.prog.removeprefix('jaxrl-hex ')}: {message}; see `{self.prog} --help`")


def fail(message: str) -> int:
  print(f"jaxrl-hex: error: {message}", file=sys.stderr)
  return 2


def run(parser: Parser, command, argv, extras: bool = False) -> int:
  """Parses argv and calls command(args) (command(args, unparsed) with extras=True, for the
  --config.* overrides); returns the exit code. The command returns None (done) or an int."""
  try:
    if extras:
      args, unparsed = parser.parse_known_args(argv)
      code = command(args, unparsed)
    else:
      code = command(parser.parse_args(argv))
  except SystemExit as e:  # --help printed its text
    return e.code if isinstance(e.code, int) else 0
  except UserError as e:
    return fail(str(e))
  except RunStopped as e:
    fail(str(e))
    return 3
  return 0 if code is None else code
