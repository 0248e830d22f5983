"""host_memory: under JAXRL_HEX_MALLOC=keep, a jitted program's 64 MB temporary is an earlier
call's memory (no page faults); with malloc as it is (the default), every call faults it in afresh."""
import json
import os
import subprocess
import sys

from support import ROOT

# A program whose only large buffer is its temporary: [8192, 2048] fp32 between two matmuls.
PROGRAM = """
import json, resource, sys
from jaxrl_hex.host_memory import keep_freed_memory
kept = keep_freed_memory()  # before JAX's CPU backend starts, as meshes.prepare_cpu_devices calls it
import jax, jax.numpy as jnp
f = jax.jit(lambda x, w, v: (x @ w) @ v)
x, w, v = jnp.ones((8192, 256)), jnp.ones((256, 2048)), jnp.ones((2048, 8))
faults = []
for _ in range(8):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x, w, v).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _faults(malloc: str) -> dict:
  env = dict(os.environ, JAXRL_HEX_MALLOC=malloc, PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_buffers_are_reused_without_page_faults():
  kept, system = _faults("keep"), _faults("")
  temp_pages = 8192 * 2048 * 4 // 4096  # 16,384 pages of 4 KiB
  assert kept["kept"] and not system["kept"]
  # malloc as it is: each call maps the temporary afresh and faults in every page of it
  assert min(system["faults"][1:]) >= temp_pages
  # kept: a later call reuses the temporary's pages. Not every one: this VM's memory manager takes
  # idle pages back from a process now and then (all but one call in a loaded CI run), whatever
  # malloc does; with malloc as it is, no call can.
  assert min(kept["faults"][1:]) < temp_pages // 20, kept
