"""docs/cli.md is generated from the flags; it must match what the code defines now."""
import importlib.util
import os

from support import ROOT


def test_cli_reference_is_current():
  spec = importlib.util.spec_from_file_location("gen_cli", os.path.join(ROOT, "docs", "gen_cli.py"))
  gen = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gen)
  text = gen.render()
  assert "## report" in text and "`--gin_file`" in text and "| `train.max_staleness` | `2` | int |" in text
  assert open(os.path.join(ROOT, "docs", "cli.md")).read() == text, "docs/cli.md is stale: run `python docs/gen_cli.py`"
