"""Name -> function tables for the pluggable RL pieces, so one config line picks a piece:

  --config.algo.advantage=rloo --config.algo.loss=gspo --config.algo.loss_agg=token-mean

A user adds a piece by registering it (`@ADVANTAGES.register("mine")` in code that runs before
training) or by naming it directly as 'package.module:function' or 'path/to/file.py:function'.
"""
from jaxrl_hex.errors import UserError
from jaxrl_hex.specs import load_object


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
      return load_object(name, self.field)
    raise UserError(f"{self.field}={name!r} is not a known {self.kind}; known: {', '.join(self.names())} "
                    "(or 'package.module:function' / 'path/to/file.py:function' for your own)")

