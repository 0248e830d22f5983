"""Name -> entry tables for the pluggable RL pieces, so one config line picks a piece:

  --config.algo.advantage=rloo --config.algo.loss=gspo --config.algo.loss_agg=token-mean

A user adds a piece by registering it in code that runs before training (`@LOSSES.register("mine")`;
an estimator declares what it needs: `@ADVANTAGES.register("mine", needs_groups=True)`) or by naming
it directly as 'package.module:function' or 'path/to/file.py:function' (an entry with the defaults).
"""
import dataclasses
from collections.abc import Callable

from jaxrl_hex.errors import UserError
from jaxrl_hex.specs import load_object


@dataclasses.dataclass(frozen=True)
class Entry:
  """A registered piece. Registries whose pieces carry properties (read by the trainer and the
  config checks) declare a subclass with those fields and their defaults."""
  fn: Callable


class Registry:

  def __init__(self, kind: str, field: str, entry: type[Entry] = Entry):
    self.kind, self.field, self.entry = kind, field, entry  # e.g. "advantage estimator", "algo.advantage"
    self._entries: dict[str, Entry] = {}

  def register(self, name: str, fn=None, **properties):
    """@REG.register("name", **properties) or REG.register("name", fn, **properties); the
    properties are the entry type's fields (a TypeError names any it lacks). Returns fn."""

    def add(fn):
      self._entries[name] = self.entry(fn, **properties)
      return fn

    return add if fn is None else add(fn)

  def names(self) -> list[str]:
    return sorted(self._entries)

  def get(self, name: str) -> Entry:
    if name in self._entries:
      return self._entries[name]
    if ":" in name:
      return self.entry(load_object(name, self.field))
    raise UserError(f"{self.field}={name!r} is not a known {self.kind}; known: {', '.join(self.names())} "
                    "(or 'package.module:function' / 'path/to/file.py:function' for your own)")
