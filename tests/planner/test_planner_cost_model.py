"""Cost model: real Qwen2 shapes, rooflines, memory feasibility and sync paths."""
import dataclasses

import jax
import pytest

from jaxrl_hex.meshes import DEFAULT_RULES
from jaxrl_hex.models.config import param_count
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.planner import cost_model as cm
from jaxrl_hex.planner.catalog import load_catalog
from jaxrl_hex.planner.model_files import load_model, with_lora

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


def _lora(name, rank=16, **lora):
  cfg = with_lora(load_model(name)[1], rank, lora.get("targets"))
  return cfg, cm.ModelCost.from_config(cfg)


def test_lora_adapters_are_counted_as_the_model_holds_them():
  # Qwen2-7B, rank 16 on all 7 projections: r x (in + out) per projection and layer
  _, m = _lora("qwen2_7b")
  per_layer = 2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944)
  assert m.adapter_params == 28 * 16 * per_layer == 40_370_176 and m.trained_bytes == 4 * m.adapter_params
  assert m.targeted_bytes == 28 * 2 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)
  # the adapters of the real model (models/lora.py), and which side of each the rules split over fsdp
  cfg, m = _lora("qwen2_1_5b", 8, targets=("q_proj", "down_proj"))
  policy = Policy.build(cfg)
  adapters, _ = policy.split(policy.shapes())
  axes, _ = policy.split(policy.logical_axes())
  sizes = [(x.size, ax) for x, ax in zip(jax.tree.leaves(adapters), jax.tree.leaves(axes, is_leaf=_is_axes))]
  assert sum(n for n, _ in sizes) == m.adapter_params
  assert sum(n for n, ax in sizes if any("fsdp" in DEFAULT_RULES[a] for a in ax)) == m.adapter_embed_params
  assert m.lora_targets == ("self_attn.q_proj", "mlp.down_proj")
  assert not cm.ModelCost.from_config(policy.base().cfg).lora


def _is_axes(x):
  return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def test_lora_train_memory_is_the_frozen_base_and_fp32_adapters():
  full, lora = cm.ModelCost.from_config(load_model("qwen2_14b")[1]), _lora("qwen2_14b")[1]
  for layout in (cm.TrainLayout(1, 8, 1, "full"), cm.TrainLayout(2, 2, 4, "dots"), cm.TrainLayout(1, 1, 1, "none")):
    shards, t = layout.fsdp * layout.tensor, layout.tensor
    adapters = lora.adapter_embed_params / layout.fsdp + lora.adapter_wide_params / t
    # the base without gradients, Adam's moments and optimizer temporaries; the adapters with all of them in fp32
    saved = 3 * full.weight_bytes / shards + cm.OPT_TEMP_BYTES * full.params / shards
    added = (4 * 4 + cm.OPT_TEMP_BYTES) * adapters
    if layout.remat == "dots":  # and each adapter's [tokens, out] product, kept beside the base's
      outputs = 2 * 5120 + (5120 + 2 * 1024 + 2 * 13824) / t  # o, down whole; q, k, v, gate, up split
      added += cm.LORA_DOTS_SAVED_BYTES * outputs * 48 * 2 * 17408
    got = cm.train_memory(full, layout, 17408, 2) - cm.train_memory(lora, layout, 17408, 2)
    assert got == pytest.approx(saved - added, rel=1e-12)
  # 14B on one H100: full fine-tuning needs 4 x 29.5 GB of state, LoRA 29.5 GB of base
  assert not list(cm.train_layouts(full, CAT["H100"], 1, 8704)) and list(cm.train_layouts(lora, CAT["H100"], 1, 8704))


def test_lora_syncs_and_gradients_are_the_adapters_alone():
  full, lora = cm.ModelCost.from_config(load_model("qwen2_7b")[1]), _lora("qwen2_7b")[1]
  bw = cm.sync_bw(CAT["H100"], CAT["H20"], False)
  ratio = cm.sync_send_time(full, 8, bw) / cm.sync_send_time(lora, 8, bw)
  assert ratio == pytest.approx(full.weight_bytes / lora.adapter_bytes, rel=1e-12) and ratio > 90
  # a replica chip receives the adapters' heads / MLP side split over tensor and their d_model side whole
  recv = cm.sync_recv_time(lora, 4, bw) * bw
  assert recv == pytest.approx(4 * (lora.adapter_embed_params + lora.adapter_wide_params / 4))
  # the step: 4N instead of 6N for forward and backward of the frozen matmuls, adapters at 8 per parameter
  layout, tokens = cm.TrainLayout(1, 8, 1, "none"), 1e6
  flops = lambda m: cm.train_time(m, CAT["H100"], layout, tokens, 4096).roofline_s * 8 * CAT["H100"].flops
  attention = 4 * full.attn_flops(tokens, 2048)
  assert flops(full) == pytest.approx(8 * full.params * tokens + attention, rel=1e-9)
  assert flops(lora) == pytest.approx((6 * full.params + 8 * lora.adapter_params) * tokens + attention, rel=1e-9)
  # FSDP still gathers the base twice; only the adapters' gradients are reduced
  comm = lambda m: cm.train_time(m, CAT["H100"], cm.TrainLayout(1, 8, 1), tokens, 4096).comm_s
  assert comm(full) / comm(lora) == pytest.approx(1.5, rel=0.02)


def test_lora_replica_holds_the_base_and_the_adapters_or_a_merged_copy():
  full, lora = cm.ModelCost.from_config(load_model("qwen2_7b")[1]), _lora("qwen2_7b")[1]
  merged = cm.ModelCost.from_config(with_lora(load_model("qwen2_7b")[1], 16), "merged")
  assert merged.merged_serving and not cm.ModelCost.from_config(load_model("qwen2_7b")[1], "merged").merged_serving
  h20 = CAT["H20"]
  assert cm.kv_capacity(full, h20, 2) - cm.kv_capacity(lora, h20, 2) == pytest.approx(4 * lora.adapter_shard(1, 2))
  assert cm.kv_capacity(full, h20, 2) - cm.kv_capacity(merged, h20, 2) == pytest.approx(lora.targeted_bytes / 2)
  slots = [cm.replica(m, h20, 1, W).slots for m in (full, lora, merged)]
  assert slots[0] >= slots[1] > slots[2]  # a merged copy of 13 GB of projections costs KV room
  # merged, a decode step reads what full fine-tuning's does; unmerged the adapters too
  assert cm.weight_read_bytes(merged, 2) == cm.weight_read_bytes(full, 2) < cm.weight_read_bytes(lora, 2)


def _with(cfg, **fields):
  out = cfg.copy_and_resolve_references()
  out.update(fields)
  return out


def test_attention_kernels_repeated_kv_heads_count_where_they_run():
  cfg = load_model("qwen2_7b")[1]  # 28 query heads, 4 KV heads, head_dim 128
  m = cm.ModelCost.from_config(cfg)
  none, dots = cm.TrainLayout(1, 4, 2, "none"), cm.TrainLayout(1, 4, 2, "dots")
  per_token = 2 * (28 - 4) * 128 * m.act_bytes / 2 * cfg.n_layers  # the repeat, split over tensor 2
  for platform in ("tpu", "gpu"):
    extra = cm.train_memory(m, none, 4096, 2, platform) - cm.train_memory(m, none, 4096, 2)
    assert extra == pytest.approx(per_token * 2 * 4096)
    assert cm.train_memory(m, dots, 4096, 2, platform) == cm.train_memory(m, dots, 4096, 2)  # recomputed
  portable = cm.ModelCost.from_config(_with(cfg, attention_kernel="portable"))
  capped = cm.ModelCost.from_config(_with(cfg, attn_logit_softcap=50.0))
  for other in (portable, capped):
    assert cm.train_memory(other, none, 4096, 2, "tpu") == cm.train_memory(other, none, 4096, 2)
  # the planner counts it: 10k-token rows on v5p at fsdp 4 x tensor 4 fit without remat only
  # when attention runs the portable path; with the kernel the planner recomputes ("dots")
  mesh = cm.TrainLayout(1, 4, 4, "none")
  assert cm.train_fits(portable, CAT["v5p"], mesh, 10240) and not cm.train_fits(m, CAT["v5p"], mesh, 10240)
  chosen = {
      x: [y.remat for y in cm.train_layouts(x, CAT["v5p"], 16, 10240) if (y.fsdp, y.tensor) == (4, 4)]
      for x in (portable, m)
  }
  assert chosen == {portable: ["none"], m: ["dots"]}
