"""The docs generators' one way to write a generated file: write it, or with --check exit 1 when
the committed one differs (for CI scripts; the tests compare the generators' output themselves)."""
import os
import sys


def write_or_check(path: str, text: str, command: str):
  """Writes `text` to `path`, or with --check on the command line compares; `command` regenerates it."""
  if "--check" in sys.argv:
    current = open(path).read() if os.path.exists(path) else ""
    if current != text:
      print(f"{os.path.relpath(path)} is out of date; run `{command}`", file=sys.stderr)
      sys.exit(1)
    return
  with open(path, "w") as f:
    f.write(text)
  print(f"wrote {path}")
