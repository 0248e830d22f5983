"""Name -> function tables for the pluggable RL pieces, so one config line picks a piece:

  --config.algo.advantage=rloo --config.algo.loss=gspo --config.algo.loss_agg=token-mean

A user adds a piece by registering it (`@ADVANTAGES.register("mine")` in code that runs before
training) or by naming it directly as 'package.module:function' or 'path/to/file.py:function'.
"""
import importlib
import importlib.util
import os

from jaxrl_hex.errors import UserError


class Registry:

  def __init__(self, kind: str, field: str):
    self.kind, self.field = kind, field  # e.g. "advantage estimator", "algo.advantage"
    self._fns = {}

  def register(self, name: str, fn=None, **attrs):
    """@REG.register("name", needs_groups=True) or REG.register("name", fn). `attrs` become
    attributes of the function (properties the trainer and config checks read)."""
    def add(fn):
      for key, value in attrs.items():
        setattr(fn, key, value)
      self._fns[name] = fn
      return fn
    return add if fn is None else add(fn)

  def names(self) -> list[str]:
    return sorted(self._fns)

  def get(self, name: str):
    if name in self._fns:
      return self._fns[name]
    if ":" in name:
      return _load(name, self.field)
    raise UserError(f"{self.field}={name!r} is not a known {self.kind}; known: {', '.join(self.names())} "
                    "(or 'package.module:function' / 'path/to/file.py:function' for your own)")


def _load(spec: str, field: str):
  where, fn_name = spec.rsplit(":", 1)
  try:
    if where.endswith(".py"):
      mod_spec = importlib.util.spec_from_file_location(f"user_{os.path.basename(where)[:-3]}", where)
      module = importlib.util.module_from_spec(mod_spec)
      mod_spec.loader.exec_module(module)
    else:
      module = importlib.import_module(where)
  except (ImportError, FileNotFoundError) as e:
    raise UserError(f"{field}={spec!r}: cannot load {where!r} ({e})") from None
  if not hasattr(module, fn_name):
    raise UserError(f"{field}={spec!r}: {where!r} has no function {fn_name!r}")
  return getattr(module, fn_name)
