"""`jaxrl-hex plan` / `jaxrl-hex simulate`: runnable mesh files, readable output, exit code 2 on bad input."""
import json

import yaml

from jaxrl_hex import meshes
from jaxrl_hex.planner.command import plan_main, simulate_main

CLUSTER = """cluster:
  - {type: H800, count: 4}
  - {type: H20, count: 4}
workload: {batch_size: 8, group_size: 4, prompt_len: 512, output_len: {mean: 1024, max: 4096, dist: fixed}, eta: 2}
"""


def test_plan_writes_runtime_mesh_file_and_simulate_reads_it(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)  # the plan goes to the current directory, not beside the cluster file
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


def test_a_cpu_cluster_pinned_to_cores_plans_pinned_pools_and_a_written_plan_is_repredicted(tmp_path):
  """meshes/cluster-cpu-mixed.yaml: an inline catalog entry, each type pinned to its cores; the plan
  pins every pool to its type's cores, and predict_written gives a written plan's figures back
  (and new ones on a refitted catalog layered over the cluster's own)."""
  import pathlib

  import pytest

  from jaxrl_hex.planner import PlanError, allocate
  from jaxrl_hex.planner.model_files import load_model
  root = pathlib.Path(__file__).parents[2]
  path = str(root / "meshes/cluster-cpu-mixed.yaml")
  cluster = allocate.load_cluster(path)
  assert cluster.cores == {"cpu": [0], "cpu-half": [1]} and cluster.catalog["cpu-half"].bf16_tflops == 0.1
  out = tmp_path / "plan.yaml"
  assert plan_main(["--cluster", path, "--model", "tiny", "--out", str(out)]) == 0
  mesh = yaml.safe_load(out.read_text())
  pools = mesh["pools"]
  assert pools["train"]["affinity"] == cluster.cores[pools["train"]["device_type"]]
  rollout = pools["rollout"]
  for g in rollout.get("replicas", []):  # a fleet's groups, or the one rollout mesh
    assert g["affinity"] == [cluster.cores[g["device_type"]]] * g["count"]
  if "replicas" not in rollout:
    assert rollout["affinity"] == cluster.cores[rollout["device_type"]]

  name, cfg = load_model("tiny")
  again = allocate.predict_written(cfg, cluster, mesh, name)
  assert round(again.rollout_s, 4) == mesh["plan"]["predicted"]["rollout_s"]
  assert round(again.step_s, 4) == mesh["plan"]["predicted"]["step_s"]
  slower = tmp_path / "fitted.yaml"  # a calibrate overlay for the inline type: on top of the cluster's catalog
  slower.write_text("devices:\n  cpu: {rollout_eff: 0.1}\n  cpu-half: {train_mfu: 0.1}\n")
  refit = allocate.predict_written(cfg, allocate.load_cluster(path, slower), mesh, name)
  assert refit.rollout_s > again.rollout_s and refit.train.step_s > again.train.step_s

  bad = tmp_path / "cluster-bad.yaml"
  for entry, match in (("{type: H100, count: 8, cores: [0]}", "cores pins simulated cpu devices"),
                       ("{type: cpu, count: 2, cores: 0}", "cores must be a list of core numbers"),
                       ("{type: cpu, count: 2, core: [0]}", r"unknown key\(s\) \['core'\]")):
    bad.write_text(f"cluster:\n  - {entry}\n")
    with pytest.raises(PlanError, match=match):
      allocate.load_cluster(bad)


def test_a_70b_plan_splits_the_sequence_and_the_runtime_reads_it(tmp_path, capsys):
  """Llama-3.1-70B's 17k-token rows fit a v5p train slice only with sequence parallelism: the
  plan says so in plan.train and writes it as the train pool's rules, which the mesh loader applies."""
  cluster = tmp_path / "cluster-v5p.yaml"
  cluster.write_text("cluster:\n  - {type: v5p, count: 64}\n"
                     "workload: {batch_size: 16, group_size: 4, prompt_len: 1024, "
                     "output_len: {mean: 4096, max: 16384}, eta: 2}\n")
  out = tmp_path / "plan.yaml"
  assert plan_main(["--cluster", str(cluster), "--model", "llama3_70b", "--out", str(out)]) == 0
  capsys.readouterr()
  plan = yaml.safe_load(out.read_text())
  assert plan["plan"]["train"]["sequence_parallel"] is True and plan["plan"]["train"]["remat"] == "full"
  assert plan["pools"]["train"]["rules"] == {"length": "tensor"}
  assert plan["pools"]["train"]["mesh"]["tensor"] > 1
  assert meshes.load_mesh_file(str(out)).pools["train"].rules["length"] == ("tensor",)


def test_plan_lora_rank_flag_writes_the_adapters_into_the_plan(tmp_path, capsys, monkeypatch):
  """Qwen2-14B on two H100 fits only with adapters: --lora-rank plans them, the file (named for
  them) carries plan.train.lora and the command that wrote it; a bad rank is one line."""
  monkeypatch.chdir(tmp_path)
  cluster = tmp_path / "cluster-two.yaml"
  cluster.write_text("cluster:\n  - {type: H100, count: 2}\n"
                     "workload: {batch_size: 8, group_size: 4, prompt_len: 512, output_len: {mean: 2048, max: 8192}}\n")
  assert plan_main(["--cluster", str(cluster), "--model", "qwen2_14b"]) == 2
  assert "--lora-rank=16" in capsys.readouterr().err
  assert plan_main(["--cluster", str(cluster), "--model", "qwen2_14b", "--lora-rank", "16"]) == 0
  text = capsys.readouterr().out
  assert "Plan for qwen2_14b, LoRA rank 16 on 7 projections (unmerged)" in text and "adapter push" in text
  out = tmp_path / "plan-two-qwen2_14b-lora16.yaml"
  header, body = out.read_text().split("\n", 1)
  assert header.endswith("--lora-rank 16 --out plan-two-qwen2_14b-lora16.yaml`.")
  train = yaml.safe_load(body)["plan"]["train"]
  assert train["lora"]["rank"] == 16 and len(train["lora"]["targets"]) == 7 and train["lora"]["serving"] == "unmerged"
  assert train["memory_gb_per_chip"] <= train["usable_gb_per_chip"]
  assert plan_main([
      "--cluster",
      str(cluster), "--model", "qwen2_14b", "--lora-rank", "16", "--lora-serving", "merged", "--out", "merged.yaml"
  ]) == 0
  capsys.readouterr()
  header, body = (tmp_path / "merged.yaml").read_text().split("\n", 1)
  assert "--lora-rank 16 --lora-serving merged --out merged.yaml" in header
  assert yaml.safe_load(body)["plan"]["train"]["lora"]["serving"] == "merged"
  for rank, match in (("-1", "model.lora.rank=-1 must be >= 0"), ("2000", "larger than self_attn.k_proj's")):
    assert plan_main(["--cluster", str(cluster), "--model", "qwen2_14b", "--lora-rank", rank]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxrl-hex: error: --lora-rank: ") and match in err and err.count("\n") == 1
