"""Heterogeneity-aware planner: device catalog, cost model, allocation solver, simulator.

It reads model configs and the device catalog and writes mesh files; it imports none of
the runtime parts, so planning runs anywhere (no accelerator, no JAX devices).
"""

from jaxrl_hex.errors import UserError


class PlanError(UserError):
  """Bad planner input; the message is one line naming the field and the fix."""
