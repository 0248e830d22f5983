"""Cost model: real Qwen2 shapes, rooflines, memory feasibility and sync paths."""
import dataclasses

import pytest

from jaxrl_hex.models.config import param_count
from jaxrl_hex.planner import cost_model as cm
from jaxrl_hex.planner.catalog import load_catalog
from jaxrl_hex.planner.model_files import load_model

CAT = load_catalog()
W = cm.Workload()


@pytest.mark.parametrize("name,billions", [("qwen2_1_5b", 1.54), ("qwen2_7b", 7.62), ("qwen2_14b", 14.77)])
def test_qwen2_configs_have_published_sizes(name, billions):
  _, cfg = load_model(name)
  assert param_count(cfg) / 1e9 == pytest.approx(billions, abs=0.01)
  assert cfg.vocab_size in (151936, 152064) and cfg.head_dim == 128 and cfg.qkv_bias
  assert cfg.param_dtype == "bfloat16"
  assert cfg.tie_embeddings == (name == "qwen2_1_5b")


def test_decode_is_bandwidth_bound_and_training_compute_bound():
  m = cm.ModelCost.from_config(load_model("qwen2_7b")[1])
  h20, h800 = CAT["H20"], CAT["H800"]
  # One decode step reads the weights: time follows HBM bandwidth, so H20 (4 TB/s) beats H800 (2 TB/s).
  d20, d800 = (cm.decode_time(m, d, 1, 16, 3072) for d in (h20, h800))
  assert d20.roofline_s == pytest.approx(d800.roofline_s * 2000 / 4000, rel=1e-6)
  # Training follows FLOPs: H800 is 756/148 = 5.1x faster per chip.
  layout = cm.TrainLayout(1, 8, 1)
  t20, t800 = (cm.train_time(m, d, layout, 1e6, 4096) for d in (h20, h800))
  assert t20.roofline_s / t800.roofline_s == pytest.approx(756 / 148, rel=1e-6)
  # 8N FLOPs per token (6N train + 2N proximal forward) dominate.
  assert t800.roofline_s * 8 * 756e12 == pytest.approx(8 * m.params * 1e6, rel=0.1)


def test_memory_feasibility():
  m14 = cm.ModelCost.from_config(load_model("qwen2_14b")[1])
  assert cm.replica(m14, CAT["L4"], 1, W) is None  # 29.5 GB of weights on a 24 GB chip
  assert cm.replica(m14, CAT["L4"], 4, W) is not None  # fits sharded over 4
  assert cm.replica(m14, CAT["H20"], 3, W) is None  # 40 heads do not split 3 ways
  r = cm.replica(m14, CAT["H20"], 1, W)
  assert 1 <= r.slots <= W.max_concurrency
  assert not list(cm.train_layouts(m14, CAT["H100"], 1, 17408))  # 14B + Adam on one chip
  assert list(cm.train_layouts(m14, CAT["H100"], 8, 17408))


def test_layouts_are_the_ones_the_runtime_accepts():
  m7 = cm.ModelCost.from_config(load_model("qwen2_7b")[1])
  m15 = cm.ModelCost.from_config(load_model("qwen2_1_5b")[1])
  # 24 chips: data x fsdp must divide the batch and tensor the 4 KV heads: 512 sequences leave nothing.
  assert not list(cm.train_layouts(m7, CAT["H800"], 24, 5120, 512))
  # each mesh with the least recomputing remat that fits: full activations of 5k tokens do not at fsdp 8
  assert cm.TrainLayout(3, 8, 1, "dots") in list(cm.train_layouts(m7, CAT["H800"], 24, 5120, 384))
  assert all(512 % (t.data * t.fsdp) == 0 for t in cm.train_layouts(m7, CAT["H800"], 16, 5120, 512))
  # Rollout replicas: a tensor degree that splits the 12 heads but not the 2 KV heads of 1.5B is out.
  assert cm.replica(m15, CAT["H20"], 2, W) is not None and cm.replica(m15, CAT["H20"], 4, W) is None
  # One runtime per pool: whole GPU hosts unless smaller than one; TPU slices of the catalog's sizes.
  assert [n for n in (4, 8, 12, 16, 21, 24) if CAT["H800"].runtime_sizes_ok(n)] == [4, 8, 16, 24]
  assert [n for n in (2, 4, 12, 16, 24, 32) if CAT["v5e"].runtime_sizes_ok(n)] == [2, 4, 16, 32]
  assert CAT["v5p"].slice_chips[:3] == (4, 8, 16) and not CAT["v5p"].runtime_sizes_ok(12)
  assert CAT["cpu"].runtime_sizes_ok(5)


def test_sync_uses_link_inside_a_fabric_and_host_network_across():
  tpu, gpu = CAT["v5p"], CAT["H100"]
  assert cm.sync_bw(tpu, tpu, True) == tpu.link_gb_s * 1e9
  assert cm.sync_bw(tpu, gpu, True) == min(tpu.host_net_gb_s, gpu.host_net_gb_s) * 1e9
  assert cm.sync_bw(gpu, gpu, False) == gpu.host_net_gb_s * 1e9


def test_workload_parsing_errors():
  w = cm.Workload.from_dict({"output_len": {"mean": 100, "max": 400, "dist": "fixed"}, "eta": 2})
  assert (w.output_mean, w.output_max, w.output_dist, w.eta) == (100, 400, "fixed", 2)
  with pytest.raises(cm.PlanError, match="unknown key"):
    cm.Workload.from_dict({"batch": 3})
  with pytest.raises(cm.PlanError, match="below mean"):
    cm.Workload.from_dict({"output_len": {"mean": 100, "max": 50}})


def test_sequence_parallelism_where_a_mesh_does_not_fit_without_it():
  m70 = cm.ModelCost.from_config(load_model("llama3_70b")[1])
  plain, sp = cm.TrainLayout(1, 8, 4, "full"), cm.TrainLayout(1, 8, 4, "full", sequence_parallel=True)
  # 70B at a 17k-token row on v5p-32: the residual stream the backward keeps splits over tensor
  assert not cm.train_fits(m70, CAT["v5p"], plain, 17408) and cm.train_fits(m70, CAT["v5p"], sp, 17408)
  assert cm.train_memory(m70, plain, 17408) - cm.train_memory(m70, sp, 17408) > 30e9
  layouts = list(cm.train_layouts(m70, CAT["v5p"], 32, 17408, 512))
  assert sp in layouts and all(x.sequence_parallel for x in layouts)
  assert sp.rules() == {"length": "tensor"} and plain.rules() == {}
  # sequence parallelism is the last resort (remat full) of a mesh that fits nothing else
  m14 = cm.ModelCost.from_config(load_model("qwen2_14b")[1])
  for m, dev, n in ((m70, "v5p", 32), (m14, "H100", 8), (m14, "v5p", 16)):
    for x in cm.train_layouts(m, CAT[dev], n, 17408):
      plain = [dataclasses.replace(x, remat=r, sequence_parallel=False) for r in cm.REMATS]
      assert x.sequence_parallel == (x.tensor > 1 and not any(cm.train_fits(m, CAT[dev], p, 17408) for p in plain))
      assert x.remat == "full" or not x.sequence_parallel
  assert not list(cm.train_layouts(m70, CAT["H100"], 8, 17408))  # 70B + Adam state alone: 70 GB per H100
