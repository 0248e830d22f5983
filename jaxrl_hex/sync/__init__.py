"""Weight sync: the train side publishes (version, params) in its layout and gets back a small
picklable Handle; the rollout side turns a handle into params in its own layout.

  device_put  one JAX runtime: reshard onto the rollout shardings at publish time
  orbax       any runtimes sharing a path: save from the train layout, restore straight onto
              the rollout layout (an abstract target carrying the rollout shardings)
  direct      Ray runtimes: every trainer process puts its own shards in the object store;
              each rollout process fetches only the shards overlapping its devices (sync/direct.py);
              on one host the train process writes into the rollout layouts' regions in shared
              memory instead (sync/shared_memory.py)
"""
from jaxrl_hex.errors import UserError
from jaxrl_hex.sync.device_put import DevicePutSync
from jaxrl_hex.sync.direct import DirectSync
from jaxrl_hex.sync.orbax_sync import OrbaxSync
from jaxrl_hex.sync.shared_memory import SLOTS

METHODS = ("device_put", "orbax", "direct")
TRANSPORTS = ("auto", "object_store", "shared_memory")  # direct's


def make_sync(method, shapes, target_shardings=None, directory="", layouts=(), slots=SLOTS):
  """target_shardings: the rollout layout, needed where params are received (None: publish only).
  layouts, slots: direct on a train side sharing its host with the rollout processes (DirectSync)."""
  if method == "device_put":
    return DevicePutSync(target_shardings)
  if method == "orbax":
    return OrbaxSync(directory, shapes, target_shardings)
  if method == "direct":
    return DirectSync(shapes, target_shardings, layouts, slots)
  raise UserError(f"sync.method: unknown {method!r}; choose one of {METHODS}")
