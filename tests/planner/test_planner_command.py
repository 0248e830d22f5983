"""`jaxrl-hex plan` / `jaxrl-hex simulate`: runnable mesh files, readable output, exit code 2 on bad input."""
import json

import yaml

from jaxrl_hex.planner.command import plan_main, simulate_main

CLUSTER = """cluster:
  - {type: H800, count: 4}
  - {type: H20, count: 4}
workload: {batch_size: 8, group_size: 4, prompt_len: 512, output_len: {mean: 1024, max: 4096, dist: fixed}, eta: 2}
"""


def test_plan_writes_runtime_mesh_file_and_simulate_reads_it(tmp_path, capsys):
  cluster = tmp_path / "cluster-small.yaml"
  cluster.write_text(CLUSTER)
  assert plan_main(["--cluster", str(cluster), "--model", "qwen2_1_5b"]) == 0
  text = capsys.readouterr().out
  assert "train    " in text and "Homogeneous alternatives" in text and "$" in text
  out = tmp_path / "plan-small-qwen2_1_5b.yaml"
  mesh = yaml.safe_load(out.read_text())
  assert mesh["platform"] == "gpu"
  train, rollout = mesh["pools"]["train"], mesh["pools"]["rollout"]
  assert train["device_type"] == "H800" and isinstance(train["devices"], int)
  assert set(train["mesh"]) == {"data", "fsdp", "tensor"}
  assert train["mesh"]["data"] * train["mesh"]["fsdp"] * train["mesh"]["tensor"] == train["devices"]
  assert set(rollout["mesh"]) == {"data", "tensor"}
  assert rollout["devices"] == sum(g["count"] * g["tensor"] for g in mesh["plan"]["sim"]["replicas"])
  assert mesh["plan"]["predicted"]["gen_tokens_per_s"] > 0 and set(mesh["plan"]["alternatives"]) == {"H800", "H20"}

  png = tmp_path / "t.png"
  assert simulate_main(["--plan", str(out), "--out", str(png), "--steps", "4", "--json"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["steps"] == 4 and png.exists() and result["gen_tokens_per_s"] > 0


def test_plan_json_and_explicit_out(tmp_path, capsys):
  cluster = tmp_path / "c.yaml"
  cluster.write_text(CLUSTER)
  out = tmp_path / "plan-x.yaml"
  assert plan_main([
      "--cluster",
      str(cluster), "--model", "configs/models/qwen2_1_5b.py", "--objective", "cost", "--json", "--out",
      str(out)
  ]) == 0
  data = json.loads(capsys.readouterr().out)
  assert data["plan"]["objective"] == "cost" and yaml.safe_load(out.read_text())["pools"] == data["pools"]


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
  cluster = tmp_path / "c.yaml"
  cluster.write_text("cluster:\n  - {type: H100, count: 1}\n")
  cases = [
      ["--cluster", str(cluster), "--model", "qwen2_1_5b"],  # no room for a replica
      ["--cluster", str(tmp_path / "missing.yaml"), "--model", "qwen2_1_5b"],
      ["--cluster", str(cluster), "--model", "no_such_model"],
  ]
  for argv in cases:
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxrl-hex: error: ") and err.count("\n") == 1 and "Traceback" not in err
  extra = tmp_path / "extra.yaml"
  extra.write_text("devices:\n  H100: {hbm_gb: null}\n")
  assert plan_main(["--cluster", str(cluster), "--model", "qwen2_1_5b", "--catalog", str(extra)]) == 2
  assert "'hbm_gb'" in capsys.readouterr().err
  assert simulate_main(["--plan", str(cluster)]) == 2
  assert "plan.sim" in capsys.readouterr().err
