"""8 simulated CPU devices for every test: two 4-device pools with different layouts."""
import atexit
import os
import shutil
import tempfile

# One persistent XLA cache for the session, this process and every one it starts (train
# subprocesses, Ray workers): the suite compiles the same small programs in many runtimes. Fresh
# per session, so a run never reads programs an older checkout compiled.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl-hex-xla-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

# XLA:CPU's backend (LLVM) optimisation off: the suite's programs are small and most run a few
# times, so compiling them cost more than running them (the full suite 25:14 -> 17:36 in one pair
# of runs on the 2-core CI machine). The programs compute the same things with slower machine code;
# results may differ in the last bits from an optimised build, so tests compare runs made alike.
# Benchmarks and users keep XLA's default.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("JAXRL_HEX_QUIET", "1")

import filelock  # noqa: E402
import pytest  # noqa: E402
from support import RESUMED_AT, RESUMED_STEPS, ROOT, SMALL, load_config  # noqa: E402

from jaxrl_hex import meshes  # noqa: E402


@pytest.fixture(scope="session")
def pools():
  return meshes.build_pools(meshes.load_mesh_file(os.path.join(ROOT, "meshes", "cpu-8.yaml")))


def _session_run(tmp_path_factory, name, build):
  """WORKDIR of a run the whole session shares: build(WORKDIR) runs once. Under pytest-xdist the
  workers of one session share it: the first to ask builds it, the rest wait."""
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's, never an older one's
  workdir = root / name
  with filelock.FileLock(str(root / f"{name}.lock")):
    if not (workdir / "done").exists():
      shutil.rmtree(workdir, ignore_errors=True)  # a worker that died half-way
      build(str(workdir))
      (workdir / "done").touch()
  return str(workdir)


@pytest.fixture(scope="session")
def warm_workdir(tmp_path_factory):
  """An SFT run that the RL tests start from (init_from), so they skip the warm start."""
  from jaxrl_hex import commands
  cfg = load_config(**SMALL, **{"sft.max_steps": 240, "sft.target_accuracy": 0.2})
  return _session_run(tmp_path_factory, "warm", lambda workdir: commands.sft(cfg, workdir))


@pytest.fixture(scope="session")
def calculator_warm(tmp_path_factory):
  """A supervised warm start of the calculator tool task (tests/support_agentic.py's settings):
  the agentic RL tests start from it, so its episodes call the tool."""
  from support_agentic import calculator_config

  from jaxrl_hex import commands
  cfg = calculator_config(**{"sft.max_steps": 200, "sft.target_accuracy": 0.2})
  return _session_run(tmp_path_factory, "calculator_warm", lambda workdir: commands.sft(cfg, workdir))


@pytest.fixture(scope="session")
def resumed_run(tmp_path_factory, warm_workdir):
  """SMALL RL from the warm start, RESUMED_AT steps, then `train --resume --config.train.steps=RESUMED_STEPS`
  through the CLI (checkpoints RESUMED_AT and RESUMED_STEPS): test_report's run and test_cli's resume
  test's. Tests read it; one that trains on copies it first."""
  from jaxrl_hex import cli, commands

  def build(workdir):
    commands.train(load_config(**SMALL, **{"init_from": warm_workdir, "train.steps": RESUMED_AT}), workdir)
    assert cli.main(["train", f"--workdir={workdir}", "--resume", f"--config.train.steps={RESUMED_STEPS}"]) == 0

  return _session_run(tmp_path_factory, "resumed", build)


@pytest.fixture(scope="session")
def ray_session():
  """One local Ray for the session (starting one takes seconds); under pytest-xdist the tests
  that use it run on one worker (pytest_collection_modifyitems), which starts it."""
  import ray
  if not ray.is_initialized():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
  yield ray


def pytest_collection_modifyitems(items):
  """Under `pytest -n N --dist loadgroup` the tests of one in-process Ray session share a worker
  (tests that start Ray in a subprocess of their own go anywhere)."""
  for item in items:
    if "ray_session" in getattr(item, "fixturenames", ()):
      item.add_marker(pytest.mark.xdist_group("ray"))
