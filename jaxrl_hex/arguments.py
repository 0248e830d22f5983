"""What every jaxrl-hex command shares, so help, errors and exit codes are the same everywhere:
an argparse parser whose usage errors are one line, and one runner that maps a command's outcome
to its exit code.

  0  done                     (also --help)
  2  bad input                one line on stderr: `jaxrl-hex: error: ...`, naming the field and the fix
  3  a run stopped            one line saying how to continue it (--resume)
"""
import argparse
import json
import os
import sys

from jaxrl_hex.errors import RunStopped, UserError


class Parser(argparse.ArgumentParser):
  """argparse without abbreviations, whose usage errors are UserErrors (one line, exit 2)."""

  def __init__(self, prog: str, description: str = "", **kwargs):
    super().__init__(prog=prog, description=description, allow_abbrev=False, **kwargs)

  def error(self, message):
    raise UserError(f"{self.prog.removeprefix('jaxrl-hex ')}: {message}; see `{self.prog} --help`")


def check_out_file(path: str, example: str):
  """--out names a file to write in a directory that exists (else the results are lost when the
  file is opened, after the work); example: a file name for the hint."""
  if os.path.isdir(path):
    raise UserError(f"--out={path} is a directory; name the file to write, e.g. --out={os.path.join(path, example)}")
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise UserError(f"--out={path}: directory {parent} does not exist; create it or write elsewhere")


def jsonl_rows(path: str, flag: str, record: str):
  """The JSON objects of a JSONL file, one per non-empty line -> [(line number, row)]; one-line
  errors for a missing file, a directory, a line that is not JSON and a file without rows
  (record: what a line holds, for the hint)."""
  if not os.path.exists(path):
    raise UserError(f"{flag}: {path!r} does not exist; name a JSONL file, one {record} per line")
  if os.path.isdir(path):
    raise UserError(f"{flag}: {path!r} is a directory; name a JSONL file, one {record} per line")
  rows = []
  with open(path) as f:
    for i, line in enumerate(f):
      if not line.strip():
        continue
      try:
        rows.append((i + 1, json.loads(line)))
      except ValueError as e:
        raise UserError(f"{flag}: line {i + 1} of {path} is not JSON ({e}); write one {record} per line") from None
  if not rows:
    raise UserError(f"{flag}: {path} holds nothing; write one {record} per line")
  return rows


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
