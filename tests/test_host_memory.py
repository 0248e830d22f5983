"""host_memory: a jitted program's 64 MB temporary is faulted in as 16,384 pages of 4 KiB on every
call by default (system: malloc as glibc sets it up), as 2 MiB pages under huge (the CLI restarts
itself with glibc's tunable), and from an earlier call's memory under keep; in every mode a
program restarts with streaming copies (x86 glibc), a tunable glibc itself reads back."""
import json
import os
import subprocess
import sys

import pytest
from support import ROOT

from jaxrl_hex import host_memory

# A program whose only large buffer is its temporary: [8192, 2048] fp32 between two matmuls.
PROGRAM = """
import json, os, resource, sys
from jaxrl_hex.host_memory import keep_freed_memory, restart_with_tunables
restart_with_tunables()  # as the CLI's entry point does
kept = keep_freed_memory()  # before JAX's CPU backend starts, as meshes.prepare_cpu_devices calls it
import jax, jax.numpy as jnp
f = jax.jit(lambda x, w, v: (x @ w) @ v)
x, w, v = jnp.ones((8192, 256)), jnp.ones((256, 2048)), jnp.ones((2048, 8))
faults = []
for _ in range(8):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x, w, v).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults, "tunables": os.environ.get("GLIBC_TUNABLES", "")}))
"""
TEMP_PAGES = 8192 * 2048 * 4 // 4096  # 16,384 pages of 4 KiB
STREAMING = [host_memory.STREAMING_COPIES_TUNABLE
            ] if host_memory.tunables()[:1] == [host_memory.STREAMING_COPIES_TUNABLE] else []  # x86 glibc


def _faults(malloc: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  env.update(JAXRL_HEX_MALLOC=malloc, PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_huge_restarts_with_huge_pages_and_faults_512x_fewer_pages_than_the_default():
  if not (host_memory.kernel_offers_huge_pages() and host_memory._glibc_version() >= (2, 35)):
    pytest.skip("this kernel or glibc offers no transparent huge pages")
  huge, system = _faults("huge"), _faults("")
  assert huge["tunables"].split(":") == STREAMING + [host_memory.HUGE_PAGES_TUNABLE]
  assert system["tunables"].split(":") == STREAMING
  assert not huge["kept"] and not system["kept"]
  # malloc as it is: each call maps the temporary afresh and faults in every 4 KiB page of it
  assert min(system["faults"][1:]) >= TEMP_PAGES
  # huge: still mapped afresh, but 32 faults of 2 MiB cover it (the rest: the program's small buffers)
  assert max(huge["faults"][1:]) < TEMP_PAGES // 20, huge


def test_freed_buffers_are_reused_without_page_faults():
  kept = _faults("keep")
  assert kept["kept"] and kept["tunables"].split(":") == STREAMING
  # kept: a later call reuses the temporary's pages. Not every one: this VM's memory manager takes
  # idle pages back from a process now and then (all but one call in a loaded CI run), whatever
  # malloc does; with malloc as it is, no call can.
  assert min(kept["faults"][1:]) < TEMP_PAGES // 20, kept


def test_the_tunables_join_the_ones_set_once(monkeypatch):
  huge = [host_memory.HUGE_PAGES_TUNABLE]
  assert host_memory.with_tunables({}, huge)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
  env = host_memory.with_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"}, huge)
  assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "PATH": "/bin"}
  assert host_memory.with_tunables(env, huge) == env
  both = host_memory.with_tunables(env, [host_memory.STREAMING_COPIES_TUNABLE, *huge])
  assert both["GLIBC_TUNABLES"] == f"{env['GLIBC_TUNABLES']}:{host_memory.STREAMING_COPIES_TUNABLE}"
  said = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.cpu.x86_non_temporal_threshold=0x1000000"}
  assert host_memory.with_tunables(said, host_memory.tunables() + huge) == said  # the user's own choices stand
  monkeypatch.setenv("JAXRL_HEX_MALLOC", "huge")
  monkeypatch.setenv("GLIBC_TUNABLES", env["GLIBC_TUNABLES"])
  assert not host_memory.huge_pages_pending()  # already started with it: no restart, no loop
  monkeypatch.delenv("GLIBC_TUNABLES")
  offered = host_memory.kernel_offers_huge_pages() and host_memory._glibc_version() >= (2, 35)
  assert host_memory.huge_pages_pending() == offered
  assert host_memory.tunables() == STREAMING + huge * offered
  monkeypatch.delenv("JAXRL_HEX_MALLOC")  # the default, system: streaming copies alone
  assert not host_memory.huge_pages_pending() and host_memory.tunables() == STREAMING


def test_glibc_reads_the_streaming_copies_tunable_back():
  if not STREAMING:
    pytest.skip("not x86 glibc")
  loader = next(
      p for p in ("/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2") if os.path.exists(p))
  listed = lambda env: subprocess.run([loader, "--list-tunables"], env=env, capture_output=True, text=True).stdout
  if "x86_non_temporal_threshold" not in listed({}):
    pytest.skip("this glibc lists no tunables (2.33 lists them)")
  name, value = host_memory.STREAMING_COPIES_TUNABLE.split("=")
  got = listed(host_memory.with_tunables({}, STREAMING))
  assert f"{name}: {value} " in got  # glibc took the name and the value as they are written


def test_an_unknown_mode_names_the_variable_and_the_modes():
  out = subprocess.run([sys.executable, "-m", "jaxrl_hex.cli", "--version"],
                       env=dict(os.environ, JAXRL_HEX_MALLOC="huge-pages",
                                PYTHONPATH=ROOT), capture_output=True, text=True)
  assert out.returncode == 2
  assert out.stderr.strip() == ("jaxrl-hex: error: JAXRL_HEX_MALLOC='huge-pages' is not a mode; use one of system, "
                                "huge, keep (jaxrl_hex/host_memory.py)")


def test_huge_on_a_machine_without_it_says_why_and_runs_on(monkeypatch, capsys):
  monkeypatch.setenv("JAXRL_HEX_MALLOC", "huge")
  monkeypatch.setenv("GLIBC_TUNABLES", host_memory.STREAMING_COPIES_TUNABLE)  # all that is left to ask
  monkeypatch.setattr(host_memory, "_glibc_version", lambda: (2, 31))
  host_memory.restart_with_tunables()  # no restart: it would replace the test's process
  assert capsys.readouterr().err == ("jaxrl-hex: JAXRL_HEX_MALLOC=huge: glibc 2.31 has no glibc.malloc.hugetlb "
                                     "tunable (2.35 has); running with malloc as glibc sets it up\n")
  monkeypatch.setattr(host_memory, "_glibc_version", lambda: ())
  assert host_memory.huge_pages_missing() == "the C library is not glibc"
  monkeypatch.setattr(host_memory, "_glibc_version", lambda: (2, 36))
  monkeypatch.setattr(host_memory, "kernel_offers_huge_pages", lambda: False)
  assert host_memory.huge_pages_missing().startswith("the kernel offers no transparent huge pages")
  assert not host_memory.huge_pages_pending()
  monkeypatch.setenv("GLIBC_TUNABLES", host_memory.HUGE_PAGES_TUNABLE)  # started with it: nothing to say
  assert host_memory.huge_pages_missing() is None
  monkeypatch.delenv("GLIBC_TUNABLES")
  monkeypatch.setenv("JAXRL_HEX_MALLOC", "system")
  assert host_memory.huge_pages_missing() is None
