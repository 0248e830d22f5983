"""Python named on the command line: 'package.module:name' or 'path/to/file.py:name'.

Tasks (config.task), RL pieces (algo.advantage / loss / loss_agg), config files (--config=FILE.py)
and planner model files (plan --model) are all loaded here, so each gets the same errors: one line
naming the field, what was missing and the fix.
"""
import importlib
import importlib.util
import os
import re

from jaxrl_hex.errors import UserError


def load_module(where: str, field: str):
  """A module by import path, or a .py file run as a fresh module named after its path."""
  if not where:
    raise UserError(f"{field} is empty; name a file (path/to/file.py) or a module on the Python path")
  if not where.endswith(".py") and ("/" in where or os.sep in where):
    # a path, never an import path: say what it should be rather than Python's "No module named"
    hint = f"did you mean {where}.py? " if os.path.isfile(where + ".py") else ""
    raise UserError(f"{field}: {where!r} is not a .py file; {hint}name a Python file (path/to/file.py) or a module "
                    "on the Python path")
  if where.endswith(".py"):
    if not os.path.isfile(where):
      raise UserError(f"{field}: file {where!r} does not exist; check the path (relative paths start at the "
                      "current directory)")
    name = "jaxrl_hex_user_" + re.sub(r"\W", "_", os.path.abspath(where))
    spec = importlib.util.spec_from_file_location(name, where)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  try:
    return importlib.import_module(where)
  except (ImportError, ValueError, TypeError) as e:  # ValueError, TypeError: names like '.x' or 'a..b'
    raise UserError(f"{field}: cannot import {where!r} ({e}); name a module on the Python path or a .py file") from None


def load_object(spec: str, field: str, what: str = "function"):
  """'where:name' -> the object `name` of module `where` (see load_module)."""
  if ":" not in spec:
    raise UserError(f"{field}={spec!r}: expected 'package.module:{what}' or 'path/to/file.py:{what}'")
  where, name = spec.rsplit(":", 1)
  module = load_module(where, field)
  if not hasattr(module, name):
    raise UserError(f"{field}={spec!r}: {where!r} has no {what} {name!r}; define it there or fix the name")
  return getattr(module, name)
