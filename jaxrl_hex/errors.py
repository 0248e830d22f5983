"""Errors caused by the user's input. The CLI prints their message as one line and exits 2;
every message names the field or file at fault and how to fix it."""


class UserError(ValueError):
  pass
