"""jaxrl-hex generate on a checkpoint written here (no training needed)."""
import json
import os

import pytest
from support import SMALL, load_config

from jaxrl_hex import cli
from jaxrl_hex.checkpoint import Checkpointer
from jaxrl_hex.runtime import build_runtime


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, pools):
  workdir = str(tmp_path_factory.mktemp("gen"))
  cfg = load_config(**SMALL)
  rt = build_runtime(cfg)
  params = rt.policy.init(0, pools["train"].shardings_for(rt.policy.logical_axes(), rt.policy.shapes()))
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(cfg.to_json_best_effort())
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  ckpt.save(12, {"params": params}, {"policy_version": 12})
  ckpt.close()
  return workdir


def test_generate_writes_one_line_per_sample_and_a_summary(run_dir, tmp_path, capsys):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "12+30=", "id": "a"}\n{"prompt": "7+5=", "n": 3, "max_tokens": 2}\n')
  out = tmp_path / "out.jsonl"
  assert cli.main(
      ["generate", f"--workdir={run_dir}", f"--prompts={prompts}", f"--out={out}", "--samples=2", "--slots=4"]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert sorted((str(r["id"]), r["sample"]) for r in rows) == [("1", 0), ("1", 1), ("1", 2), ("a", 0), ("a", 1)]
  for r in rows:
    assert r["version"] == 12 and len(r["tokens"]) == len(r["logprobs"]) >= 1
    assert r["finish_reason"] in ("eos", "length") and r["truncated"] == (r["finish_reason"] == "length")
    assert len(r["tokens"]) <= (2 if r["id"] == 1 else 6)
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["samples"] == 5 and summary["new_tokens"] == sum(len(r["tokens"]) for r in rows)
  assert summary["compile_count"] >= 2 and summary["new_tokens_per_s"] > 0 and summary["kv_cache_bytes"] > 0


def test_generate_refuses_a_missing_run(tmp_path, capsys):
  assert cli.main(["generate", f"--workdir={tmp_path}", "--prompts=x.jsonl", "--out=y.jsonl"]) == 2
  assert "config.json does not exist" in capsys.readouterr().err
