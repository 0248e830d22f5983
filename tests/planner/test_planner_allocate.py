"""Allocation: the planner matches exhaustive search, reproduces AReaL-Hex, and fails clearly."""
import dataclasses

import pytest

from jaxrl_hex.models.config import model_config
from jaxrl_hex.planner import PlanError, allocate as al, cost_model as cm
from jaxrl_hex.planner.catalog import load_catalog
from jaxrl_hex.planner.command import plan_to_mesh
from jaxrl_hex.planner.model_files import REPO, load_model, with_lora

CAT = load_catalog()
SMALL = cm.Workload(batch_size=8, group_size=4, prompt_len=512, output_mean=2048, output_max=8192)


def cluster(counts, workload=SMALL):
  return al.Cluster(counts, CAT, workload)


def groups(p):
  return [(g.option.replica.device_type, g.option.replica.tensor, g.count) for g in p.groups]


@pytest.mark.parametrize(
    "model,counts",
    [
        ("qwen2_1_5b", {
            "H800": 4,
            "H20": 4
        }),
        (
            "qwen2_1_5b",
            {  # 7B with Adam at 17k tokens needs more than 4 x 32 GB to train
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


def test_whole_prompts_per_replica_are_min_makespan():
  # Saturated replicas (a = b = 0): 10-token sequences at 100 and 50 tokens/s, prompts of 2 sequences.
  fast = al.Option(None, (0.0, 0.0, 10 / 100), 0.5, 1.0)
  slow = al.Option(None, (0.0, 0.0, 10 / 50), 0.0, 1.0)
  makespan, got = al.split_prompts([(fast, 2), (slow, 1)], 15, 2)
  # fast: 0.5 + 0.2 s per prompt, slow: 0.4 s per prompt; 6 + 5 + 4 prompts -> max(1.7, 1.5, 1.6) = 1.7,
  # and no split of 15 whole prompts finishes by 1.6 (at most 5 + 5 + 4).
  assert makespan == pytest.approx(1.7)
  assert [(g.option is fast, g.count, g.assigned) for g in got] == [(True, 1, 12), (True, 1, 10), (False, 1, 8)]
  assert [g.share(30) for g in got] == [0.4, 1 / 3, 8 / 30]
  # A replica left without a prompt is not part of the plan.
  makespan, got = al.split_prompts([(fast, 2), (slow, 3)], 1, 2)
  assert makespan == pytest.approx(0.4) and [(g.option is slow, g.count, g.assigned) for g in got] == [(True, 1, 2)]


def test_unfilled_replicas_pay_for_their_weight_reads():
  opt = al.Option(None, (2.0, 0.1, 0.2), 0.0, 1.0)  # a + b*n below saturation (n < 20)
  assert opt.seconds(10, 1) == pytest.approx(3.0)  # 2 + 0.1*10 > 0.2*10
  assert opt.seconds(40, 1) == pytest.approx(8.0)  # saturated: 0.2*40


@pytest.mark.parametrize("model", ["qwen2_7b", "qwen2_14b"])
def test_areal_hex_setting_mix_beats_equal_budget_homogeneous(model):
  """At 48 prompts x 8 (384 sequences) all 24 H800 train, with data 3 (fsdp x tensor 8, and a remat
  policy, as memory needs), and the mix wins as in the paper."""
  cfg = load_model(model)[1]
  clusters = {name: al.load_cluster(REPO / f"meshes/cluster-areal-{name}.yaml") for name in ("hex", "h800", "h20")}
  plans = {
      name: al.plan(cfg, dataclasses.replace(c, workload=dataclasses.replace(c.workload, batch_size=48)), name=model)
      for name, c in clusters.items()
  }
  mix = plans["hex"]
  assert mix.train.device_type == "H800" and mix.train.layout.devices == 24 and mix.train.layout.data == 3
  assert mix.train.memory_bytes <= cm.MEMORY_HEADROOM * CAT["H800"].hbm_bytes
  assert {g.option.replica.device_type for g in mix.groups} == {"H20"}
  for name in ("h800", "h20"):
    assert mix.gen_tokens_per_s > 1.25 * plans[name].gen_tokens_per_s
    assert mix.usd_per_mtok < plans[name].usd_per_mtok
  budgets = [sum(CAT[k].price_per_hour * n for k, n in c.counts.items()) for c in clusters.values()]
  assert max(budgets) / min(budgets) < 1.06  # equal budget, as in the paper


def test_areal_hex_at_512_sequences_trains_on_two_whole_hosts():
  """64 x 8 = 512 sequences: data x fsdp must be a power of two and tensor must divide the 4 KV heads, so no
  layout of 24 H800 runs; the planner trains on 16 and serves from the H20s, still cheaper per token."""
  cfg = load_model("qwen2_7b")[1]
  plans = {name: al.plan(cfg, al.load_cluster(REPO / f"meshes/cluster-areal-{name}.yaml")) for name in ("hex", "h800")}
  mix = plans["hex"]
  assert mix.train.layout.devices == 16 and mix.train.layout.data == 2 and mix.idle.get("H800") == 8
  assert {g.option.replica.device_type for g in mix.groups} == {"H20"}
  assert sum(g.assigned for g in mix.groups) == 512 and all(g.assigned % 8 == 0 for g in mix.groups)  # whole prompts
  assert mix.gen_tokens_per_s >= plans["h800"].gen_tokens_per_s * (1 - 1e-9)
  assert mix.usd_per_mtok < 0.8 * plans["h800"].usd_per_mtok


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


def test_lora_plans_a_model_that_no_full_fine_tuning_layout_fits():
  """Qwen2-14B on two H100: full fine-tuning needs ~118 GB per chip even over both, so nothing
  fits; with rank-16 adapters one H100 holds the frozen base (30 GB) and trains, the other serves."""
  cfg, c = load_model("qwen2_14b")[1], cluster({"H100": 2})
  with pytest.raises(PlanError, match=r"fits no device for training.*--lora-rank=16"):
    al.plan(cfg, c, name="qwen2_14b")
  lora_cfg = with_lora(cfg, 16)
  p = al.plan(lora_cfg, c, name="qwen2_14b")
  t = p.train
  assert (t.device_type, t.layout.devices, groups(p)) == ("H100", 1, [("H100", 1, 1)])
  targets = [f"self_attn.{n}_proj" for n in "qkvo"] + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
  assert t.lora == {"rank": 16, "targets": targets, "serving": "unmerged"}
  full, lora = cm.ModelCost.from_config(cfg), cm.ModelCost.from_config(lora_cfg)
  assert t.memory_bytes * (1 + cm.TRAIN_MEMORY_MARGIN) <= cm.MEMORY_HEADROOM * CAT["H100"].hbm_bytes
  # below full fine-tuning on the same step by the base's gradients and moments and its optimizer temporaries
  full_bytes = cm.train_memory(full, t.layout, t.seq_len, t.rows)
  adapters = (16 + cm.OPT_TEMP_BYTES) * lora.adapter_params  # fp32 params, grads, 2 moments; temporaries
  assert full_bytes - t.memory_bytes == pytest.approx((3 * 2 + cm.OPT_TEMP_BYTES) * full.params - adapters, rel=1e-12)
  # the push moves the adapters alone
  same = al.Problem(cfg, c).train_choice("H100", 1, [t.layout])
  assert same.send_s / t.send_s == pytest.approx(full.weight_bytes / lora.adapter_bytes, rel=1e-12)
  assert same.send_s / t.send_s == pytest.approx(2 * full.params / (4 * lora.adapter_params), rel=1e-12)


def test_lora_plan_file_carries_the_adapters_and_is_predicted_back():
  cfg, c = load_model("qwen2_14b")[1], cluster({"H100": 2})
  p = al.plan(with_lora(cfg, 16), c, name="qwen2_14b")
  mesh = plan_to_mesh(p, "qwen2_14b", c)
  assert mesh["plan"]["train"]["lora"] == p.train.lora
  assert mesh["plan"]["train"]["memory_gb_per_chip"] == round(p.train.memory_bytes / 1e9, 2)
  again = al.predict_written(cfg, c, mesh, "qwen2_14b")  # the model file's rank 0: the plan's LoRA wins
  assert again.train.lora == p.train.lora and again.step_s == pytest.approx(p.step_s, rel=1e-12)
  merged = al.plan(with_lora(cfg, 16), c, name="qwen2_14b", lora_serving="merged")  # 26 GB more per replica chip
  slots = lambda plan: plan.groups[0].option.replica.slots
  assert merged.train.lora["serving"] == "merged" and slots(merged) < slots(p)
  again = al.predict_written(cfg, c, plan_to_mesh(merged, "qwen2_14b", c), "qwen2_14b")
  assert slots(again) == slots(merged)
  c8 = cluster({"H100": 8})
  assert "lora" not in plan_to_mesh(al.plan(cfg, c8), "qwen2_14b", c8)["plan"]["train"]  # full fine-tuning
  mesh["plan"]["train"]["lora"] = {"rank": 16, "targets": ["qkv"]}
  with pytest.raises(PlanError, match=r"plan.train.lora: model.lora.targets: \['qkv'\] match\(es\) no layer"):
    al.predict_written(cfg, c, mesh, "qwen2_14b")
