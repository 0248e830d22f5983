"""The planner against AReaL-Hex's published figures (benchmarks/published_areal_hex.yaml): where the
runtime lets all 24 H800 train, its equal-budget gains fall within 6% of the paper's; docs/planner.md
carries the table `python benchmarks/planner.py --part fidelity` prints, and the example plans'
figures as `jaxrl-hex plan` computes them now (docs/gen_planner.py)."""
import importlib.util
import os

import pytest
from support import ROOT


@pytest.fixture(scope="module")
def result():
  spec = importlib.util.spec_from_file_location("planner_bench", os.path.join(ROOT, "benchmarks", "planner.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  return bench, bench.fidelity()


def test_the_equal_budget_gains_at_384_sequences_are_the_papers(result):
  _, fid = result
  at_384 = [r for r in fid["rows"] if r["prompts"] == 48]
  assert len(at_384) == 9  # 3 figures x 3 models
  for r in at_384:
    if r["figure"] != "weight_sync_share":
      assert abs(r["error"]) <= 0.06, r  # inside the published range, or within 6% of it
  lo, _ = fid["published"]["equal_budget_throughput"]["range"]
  at_512 = [r["predicted"] for r in fid["rows"] if (r["prompts"], r["figure"]) == (64, "equal_budget_throughput")]
  assert len(at_512) == 3 and all(v < lo for v in at_512), "at 512 the mix trains on 16 of 24 H800 and falls short"
  # weight sync: the planner's bound-based share, scaled by the paper's measured factor, stays below its 13.5%
  assert all(-0.9 < r["error"] < 0 for r in fid["rows"] if r["figure"] == "weight_sync_share")


def test_docs_carry_the_fidelity_table(result):
  bench, fid = result
  assert bench.fidelity_table(fid) in open(os.path.join(ROOT, "docs", "planner.md")).read()


def test_docs_quote_the_example_plans_as_the_planner_makes_them():
  spec = importlib.util.spec_from_file_location("gen_planner", os.path.join(ROOT, "docs", "gen_planner.py"))
  gen = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gen)
  table = gen.render()
  assert "| qwen2_7b | 16 H800, data 2 x fsdp 2 x tensor 4" in table  # the AReaL-Hex 7B row is there
  assert table in open(
      os.path.join(ROOT, "docs",
                   "planner.md")).read(), ("docs/planner.md's plan figures are stale: run `python docs/gen_planner.py`")
