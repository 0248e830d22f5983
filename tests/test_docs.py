"""Generated docs match their sources: docs/cli.md the flags the code defines now, and the README's
demo table the committed summary of a real run of the README's main command (which a slow test
reruns)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from support import ROOT


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "docs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_cli_reference_is_current():
  spec = importlib.util.spec_from_file_location("gen_cli", os.path.join(ROOT, "docs", "gen_cli.py"))
  gen = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gen)
  text = gen.render()
  assert "## report" in text and "`--gin_file`" in text and "| `train.max_staleness` | `2` | int |" in text
  assert open(os.path.join(ROOT, "docs", "cli.md")).read() == text, "docs/cli.md is stale: run `python docs/gen_cli.py`"


def test_readme_demo_table_is_the_committed_runs():
  gen = _load("gen_demo")
  demo = json.load(open(gen.SUMMARY))
  table = gen.render(demo)
  assert f"| held-out greedy accuracy after {demo['rl_steps']} RL steps | {demo['accuracy_end']:.3f}" in table
  assert table in open(
      gen.README).read(), "README.md's demo table is stale: run `python docs/gen_demo.py --workdir=RUN`"


@pytest.mark.slow  # minutes on 2 cores: the README's main command, whole
def test_readme_main_command_reproduces_the_demo_table(tmp_path):
  gen = _load("gen_demo")
  workdir = tmp_path / "demo"
  env = {k: v for k, v in os.environ.items() if k != "JAXRL_HEX_QUIET"}
  subprocess.run([os.path.join(os.path.dirname(sys.executable), "jaxrl-hex"), "train", f"--workdir={workdir}"],
                 cwd=ROOT, env=env, check=True, capture_output=True)
  got, want = gen.figures(str(workdir)), json.load(open(gen.SUMMARY))
  assert (got["rl_steps"], got["staleness_max"]) == (want["rl_steps"], want["staleness_max"])
  # RL's batches depend on how the pools' timings interleave: near the table, not equal to it
  assert abs(got["accuracy_warmstart"] - want["accuracy_warmstart"]) <= 0.03, got
  assert abs(got["accuracy_end"] - want["accuracy_end"]) <= 0.06, got


def test_readme_agentic_table_is_the_committed_runs():
  gen = _load("gen_agentic")
  summary = json.load(open(gen.SUMMARY))
  table = gen.render(summary)
  for key in ("calculator", "guess"):  # both learn: at least 20 points over their warm start
    assert summary[key]["accuracy_end"] - summary[key]["accuracy_warmstart"] >= 0.2, summary[key]
  assert summary["agent"]["accuracy_end"] > summary["agent"]["accuracy_warmstart"]  # the endpoint's agent learns
  assert table in open(gen.README).read(), "README.md's agentic table is stale: run `python docs/gen_agentic.py ...`"
