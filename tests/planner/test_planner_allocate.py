"""Allocation: the planner matches exhaustive search, reproduces AReaL-Hex, and fails clearly."""
import dataclasses

import pytest

from jaxrl_hex.models.config import model_config
from jaxrl_hex.planner import PlanError, allocate as al, cost_model as cm
from jaxrl_hex.planner.catalog import load_catalog
from jaxrl_hex.planner.model_files import REPO, load_model

CAT = load_catalog()
SMALL = cm.Workload(batch_size=8, group_size=4, prompt_len=512, output_mean=2048, output_max=8192)


def cluster(counts, workload=SMALL):
  return al.Cluster(counts, CAT, workload)


def groups(p):
  return [(g.option.replica.device_type, g.option.replica.tensor, g.count) for g in p.groups]


@pytest.mark.parametrize("model,counts", [
    ("qwen2_1_5b", {
        "H800": 4,
        "H20": 4
    }),
    ("qwen2_7b", {
        "v5e": 4,
        "v6e": 4
    }),
    ("qwen2_7b", {
        "A100": 5,
        "H20": 3
    }),
    ("qwen2_1_5b", {
        "v5p": 2,
        "H100": 6
    }),
    ("qwen2_1_5b", {
        "L4": 6,
        "H200": 2
    }),
])
@pytest.mark.parametrize("objective", ["throughput", "cost"])
def test_planner_equals_exhaustive_search_on_small_clusters(model, counts, objective):
  cfg = load_model(model)[1]
  got = al.plan(cfg, cluster(counts), objective)
  ref = al.exhaustive_plan(cfg, cluster(counts), objective)
  assert got.gen_tokens_per_s == pytest.approx(ref.gen_tokens_per_s, rel=1e-3)
  assert got.usd_per_mtok == pytest.approx(ref.usd_per_mtok, rel=1e-3)
  assert got.price_per_hour == pytest.approx(ref.price_per_hour, rel=1e-6)
  assert got.train.device_type == ref.train.device_type


def test_cost_objective_with_throughput_floor_equals_exhaustive():
  cfg = load_model("qwen2_1_5b")[1]
  c = cluster({"H800": 4, "H20": 4})
  fastest = al.plan(cfg, c, "throughput")
  floor = 0.6 * fastest.gen_tokens_per_s
  got = al.plan(cfg, c, "cost", floor)
  ref = al.exhaustive_plan(cfg, c, "cost", floor)
  assert got.gen_tokens_per_s >= floor
  assert got.usd_per_mtok == pytest.approx(ref.usd_per_mtok, rel=1e-3)
  cheapest = al.plan(cfg, c, "cost")
  assert cheapest.gen_tokens_per_s < floor < got.gen_tokens_per_s  # the floor bites
  with pytest.raises(PlanError, match="no allocation reaches --min-throughput"):
    al.plan(cfg, c, "cost", 10 * fastest.gen_tokens_per_s)


def test_water_fill_is_min_makespan():
  # Saturated groups (a = b = 0): 10-token sequences at 100 and 50 tokens/s per replica.
  fast = al.Option(None, (0.0, 0.0, 10 / 100), 0.5, 1.0)
  slow = al.Option(None, (0.0, 0.0, 10 / 50), 0.0, 1.0)
  makespan, x = al.water_fill([(fast, 2), (slow, 1)], 30)
  # group rates 20 and 5 seq/s: 22/8 -> max(0.5 + 22/20, 8/5) = 1.6
  assert x == [22, 8] and makespan == pytest.approx(1.6)


def test_unfilled_replicas_pay_for_their_weight_reads():
  opt = al.Option(None, (2.0, 0.1, 0.2), 0.0, 1.0)  # a + b*n below saturation (n < 20)
  assert opt.seconds(10, 1) == pytest.approx(3.0)  # 2 + 0.1*10 > 0.2*10
  assert opt.seconds(40, 1) == pytest.approx(8.0)  # saturated: 0.2*40


@pytest.mark.parametrize("model", ["qwen2_7b", "qwen2_14b"])
def test_areal_hex_setting_mix_beats_equal_budget_homogeneous(model):
  cfg = load_model(model)[1]
  plans = {
      name: al.plan(cfg, al.load_cluster(REPO / f"meshes/cluster-areal-{name}.yaml"), name=model)
      for name in ("hex", "h800", "h20")
  }
  mix = plans["hex"]
  assert mix.train.device_type == "H800" and mix.train.layout.devices == 24
  assert {g.option.replica.device_type for g in mix.groups} == {"H20"}
  for name in ("h800", "h20"):
    assert mix.gen_tokens_per_s > 1.25 * plans[name].gen_tokens_per_s
    assert mix.usd_per_mtok < plans[name].usd_per_mtok
  budgets = [
      sum(CAT[k].price_per_hour * n
          for k, n in al.load_cluster(REPO / f"meshes/cluster-areal-{name}.yaml").counts.items())
      for name in ("hex", "h800", "h20")
  ]
  assert max(budgets) / min(budgets) < 1.06  # equal budget, as in the paper


def test_tpu_gpu_and_tpu_generation_examples():
  cfg = load_model("qwen2_7b")[1]
  p = al.plan(cfg, al.load_cluster(REPO / "meshes/cluster-v5p-h100.yaml"))
  assert p.train.device_type == "H100" and {g.option.replica.device_type for g in p.groups} == {"v5p"}
  q = al.plan(cfg, al.load_cluster(REPO / "meshes/cluster-v5e-v6e.yaml"))
  assert q.train.device_type == "v6e"
  assert {g.option.replica.device_type for g in q.groups} == {"v5e"}
  assert min(g.option.replica.tensor for g in q.groups) >= 2  # 15 GB of weights on 16 GB chips


def test_model_that_fits_no_device():
  huge = model_config(vocab_size=32000, d_model=16384, n_layers=64, n_heads=128, n_kv_heads=8, head_dim=128,
                      mlp_dim=53248, param_dtype="bfloat16", dtype="bfloat16")
  with pytest.raises(PlanError) as e:
    al.plan(huge, cluster({"v5e": 4, "L4": 4}), name="huge")
  assert "fits no device for rollout" in str(e.value) and "smaller model" in str(e.value)


def test_model_too_big_to_train():
  with pytest.raises(PlanError, match="fits no device for training.*add chips"):
    al.plan(load_model("qwen2_14b")[1], cluster({"H100": 2}), name="qwen2_14b")


def test_cluster_that_cannot_host_a_replica():
  with pytest.raises(PlanError, match="cannot host one rollout replica next to a training pool"):
    al.plan(load_model("qwen2_1_5b")[1], cluster({"H100": 1}))


def test_cluster_file_errors(tmp_path):
  bad = tmp_path / "c.yaml"
  bad.write_text("cluster:\n  - {type: H900, count: 2}\n")
  with pytest.raises(PlanError, match="unknown device type 'H900'.*--catalog"):
    al.load_cluster(bad)
  bad.write_text("cluster:\n  - {type: H100}\n")
  with pytest.raises(PlanError, match=r"cluster\[0\] needs `type` and `count`"):
    al.load_cluster(bad)


def test_synchronous_eta0_adds_the_sides():
  cfg = load_model("qwen2_1_5b")[1]
  c = cluster({"H800": 4, "H20": 4}, dataclasses.replace(SMALL, eta=0))
  p = al.plan(cfg, c)
  assert p.step_s == pytest.approx(p.train.step_s + p.rollout_s + SMALL.reward_s)
  assert p.gen_tokens_per_s < al.plan(cfg, cluster({"H800": 4, "H20": 4})).gen_tokens_per_s
