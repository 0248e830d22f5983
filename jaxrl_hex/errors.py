"""Errors caused by the user's input. The CLI prints their message as one line and exits 2;
every message names the field or file at fault and how to fix it."""


class UserError(ValueError):
  pass


class ConfigError(UserError):
  """A config field that cannot work; the message names the field and the fix."""


class RunStopped(RuntimeError):
  """A run that cannot go on but can be continued (a train process was lost): the CLI prints the
  message, which says how to resume, as one line and exits 3."""
