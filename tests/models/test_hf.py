"""Hugging Face checkpoints: parity with transformers for every family, exact export, loading
onto a mesh with bounded host memory, and clear errors for broken directories."""
import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from hf_support import FAMILIES, save_tiny, torch_logits
from support import ROOT

from jaxrl_hex.models.config import model_config, param_count
from jaxrl_hex.models.families import HFModelError
from jaxrl_hex.models.hf import from_hf, hf_model_config, load_params, save_hf, tensor_layouts, to_hf
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.safetensors_files import SafetensorsDir


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("placement", ["one_device", "train_pool"])
def test_logits_and_greedy_tokens_match_transformers(family, placement, tiny_hf, pools):
  path, _, ids, logits, greedy = tiny_hf(family)
  model = from_hf(path, mesh=pools["train"] if placement == "train_pool" else None)
  if placement == "train_pool":
    assert len(model.decoder.layers[0].attn.wq[...].sharding.device_set) == 4
  np.testing.assert_allclose(np.asarray(model(ids)), logits, atol=1e-4, rtol=0)
  np.testing.assert_array_equal(np.asarray(model.generate(ids, 32)), greedy)


@pytest.mark.parametrize("family", FAMILIES)
def test_scanned_layers_load_stacked_match_transformers_and_export_exactly(family, tiny_hf, pools, tmp_path):
  path, _, ids, logits, greedy = tiny_hf(family)
  model = from_hf(path, mesh=pools["train"], scan_layers=True)
  n = model.cfg.n_layers
  wq = model.decoder.layers.attn.wq[...]  # [L, embed, heads, head_dim], layer axis whole on each device
  assert wq.shape[0] == n and len(wq.sharding.device_set) == 4 and wq.sharding.spec[0] is None
  ref = SafetensorsDir(path).read(f"model.layers.{n - 1}.mlp.up_proj.weight", (slice(None), slice(None)))
  np.testing.assert_array_equal(np.asarray(model.decoder.layers.mlp.up[...][n - 1]), ref.T)
  np.testing.assert_allclose(np.asarray(model(ids)), logits, atol=1e-4, rtol=0)
  np.testing.assert_array_equal(np.asarray(model.generate(ids, 32)), greedy)
  to_hf(model, str(tmp_path))  # unstacked again, bit for bit
  before, after = SafetensorsDir(path), SafetensorsDir(str(tmp_path))
  assert set(before.entries) == set(after.entries)
  for name, e in before.entries.items():
    full = tuple(slice(None) for _ in e.shape)
    np.testing.assert_array_equal(after.read(name, full).view(np.uint8), before.read(name, full).view(np.uint8))
  assert hf_model_config(str(tmp_path)) == hf_model_config(path)  # scan_layers is ours, not config.json's


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_layouts_cover_every_tensor_exactly(family, tiny_hf):
  path = tiny_hf(family)[0]
  cfg = hf_model_config(path)
  names = {lay.hf_name for lay in tensor_layouts(cfg)}
  assert names == set(SafetensorsDir(path).entries)
  assert sum(x.size for x in jax.tree.leaves(Policy.build(cfg).shapes())) == param_count(cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_is_exact_and_transformers_reloads_it(family, tiny_hf, tmp_path):
  import transformers
  path, _, ids, logits, _ = tiny_hf(family)
  to_hf(from_hf(path), str(tmp_path))
  before, after = SafetensorsDir(path), SafetensorsDir(str(tmp_path))
  assert set(before.entries) == set(after.entries)
  for name, e in before.entries.items():  # bit for bit
    full = tuple(slice(None) for _ in e.shape)
    np.testing.assert_array_equal(after.read(name, full).view(np.uint8), before.read(name, full).view(np.uint8))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
  np.testing.assert_allclose(torch_logits(reloaded, ids), logits, atol=1e-5, rtol=0)


def test_native_model_exports_as_llama_that_transformers_runs(tmp_path):
  import transformers
  cfg = model_config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                     tie_embeddings=True)
  policy = Policy.build(cfg)
  params = policy.init(3)
  save_hf(cfg, params, str(tmp_path))
  assert json.load(open(tmp_path / "config.json"))["architectures"] == ["LlamaForCausalLM"]
  ids = np.random.default_rng(1).integers(0, 64, (2, 9))
  ours = np.asarray(from_hf(str(tmp_path))(ids))
  theirs = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)), ids)
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_export_refuses_a_config_no_family_can_express(tmp_path):
  cfg = model_config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                     sliding_window=4)  # Llama has no sliding windows
  with pytest.raises(HFModelError, match="layer 0.*no Llama 3.x"):  # refused before any weight is read
    save_hf(cfg, Policy.build(cfg).shapes(), str(tmp_path))
  assert not os.listdir(tmp_path)


def test_bf16_checkpoint_converts_on_load_and_exports_bit_exact(tmp_path):
  src, out = str(tmp_path / "src"), str(tmp_path / "out")
  save_tiny("qwen2", src, dtype="bfloat16")
  model = from_hf(src, param_dtype="float32", dtype="float32")
  assert model.decoder.embed[...].dtype == np.float32
  raw = SafetensorsDir(src).read("model.embed_tokens.weight", (slice(None), slice(None)))
  np.testing.assert_array_equal(np.asarray(model.decoder.embed[...]), raw.astype(np.float32))
  to_hf(model, out, dtype="bfloat16")
  assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
  back = SafetensorsDir(out).read("model.embed_tokens.weight", (slice(None), slice(None)))
  np.testing.assert_array_equal(back.view(np.uint16), raw.view(np.uint16))


# peak traced host memory of load_params onto the train pool of meshes/cpu-8.yaml
LOAD_PEAK = """
import sys, tracemalloc
import jax
jax.config.update("jax_num_cpu_devices", 8)
from jaxrl_hex import meshes
from jaxrl_hex.models.hf import hf_model_config, load_params
from jaxrl_hex.models.policy import Policy
pools = meshes.build_pools(meshes.load_mesh_file("meshes/cpu-8.yaml"))
cfg = hf_model_config(sys.argv[1])
policy = Policy.build(cfg)
shardings = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
tracemalloc.start()
jax.block_until_ready(load_params(sys.argv[1], cfg, shardings))
print(tracemalloc.get_traced_memory()[1])
"""


def test_sharded_checkpoint_loads_onto_the_mesh_with_bounded_host_memory(tmp_path, pools, record_property):
  """Peak host staging memory stays near the largest tensor, far below the checkpoint."""
  path = str(tmp_path)
  save_tiny("llama", path, max_shard_size="300KB", vocab_size=1024, hidden_size=128, intermediate_size=384,
            num_hidden_layers=8)
  files = glob.glob(os.path.join(path, "*.safetensors"))
  total = sum(os.path.getsize(f) for f in files)
  cfg = hf_model_config(path)
  policy = Policy.build(cfg)
  shardings = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
  # measured in a process of its own: in the suite's worker, other tests' threads allocate too
  peak = int(
      subprocess.run([sys.executable, "-c", LOAD_PEAK, path], cwd=ROOT, capture_output=True, text=True,
                     check=True).stdout.split()[-1])
  params = jax.block_until_ready(load_params(path, cfg, shardings))
  largest = max(x.nbytes for x in jax.tree.leaves(params))
  record_property("host_peak_bytes", peak)
  print(f"\n{len(files)} shards, {total} bytes; peak host memory while loading {peak} bytes "
        f"= {peak / total:.3f} of the checkpoint, {peak / largest:.2f}x its largest tensor")
  assert len(files) >= 8
  assert peak < total / 5 and peak < 2 * largest
  assert params["layers"][3]["mlp"]["up"].sharding == shardings["layers"][3]["mlp"]["up"]
  ref = SafetensorsDir(path).read("model.layers.3.mlp.up_proj.weight", (slice(None), slice(None)))
  np.testing.assert_array_equal(np.asarray(params["layers"][3]["mlp"]["up"]), ref.T)


@pytest.fixture
def sharded_copy(tmp_path):
  """A copy of the tiny Llama saved as several shards with an index."""
  path = str(tmp_path / "llama")
  save_tiny("llama", path, max_shard_size="30KB")
  assert len(glob.glob(os.path.join(path, "*.safetensors"))) > 2
  return path


def test_missing_shard_names_the_file_and_a_tensor(sharded_copy):
  index = json.load(open(os.path.join(sharded_copy, "model.safetensors.index.json")))["weight_map"]
  name, file = sorted(index.items())[0]
  os.remove(os.path.join(sharded_copy, file))
  with pytest.raises(HFModelError, match=f"{file} is missing.*e.g. '"):
    from_hf(sharded_copy)


def test_truncated_shard_names_the_file_and_the_tensor_cut_off(sharded_copy):
  index = json.load(open(os.path.join(sharded_copy, "model.safetensors.index.json")))["weight_map"]
  file = index["model.layers.1.mlp.down_proj.weight"]
  path = os.path.join(sharded_copy, file)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 100)
  with pytest.raises(HFModelError, match=f"{file} is truncated: .* but tensor '.*' ends at byte"):
    from_hf(sharded_copy)


def test_wrong_tensor_shape_names_the_file_and_the_tensor(sharded_copy):
  config = json.load(open(os.path.join(sharded_copy, "config.json")))
  config["intermediate_size"] = 48
  json.dump(config, open(os.path.join(sharded_copy, "config.json"), "w"))
  with pytest.raises(
      HFModelError, match=r"model-\d+-of-\d+.safetensors: tensor 'model.layers.0.mlp.\w+_proj.weight' "
      r"has shape \[\d+, \d+\] but config.json implies"):
    from_hf(sharded_copy)


def test_unexpected_tensor_is_refused(tiny_hf, tmp_path):
  path = str(tmp_path / "m")
  shutil.copytree(tiny_hf("llama")[0], path)
  config = json.load(open(os.path.join(path, "config.json")))
  config["num_hidden_layers"] = 1
  json.dump(config, open(os.path.join(path, "config.json"), "w"))
  with pytest.raises(HFModelError, match="tensor 'model.layers.1..*' .* is not part of a llama model"):
    from_hf(path)


@pytest.mark.parametrize("edit, message", [
    ({
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 1e4
        }
    }, r"config.json: rope_parameters.rope_type='yarn' is not supported; supported: \['default', 'linear', 'llama3'\]"),
    ({
        "mlp_bias": True
    }, "config.json: mlp_bias=True is set; the Llama 3.x decoder here cannot honour it"),
    ({
        "hidden_act": "relu2"
    }, "config.json: hidden_act='relu2' is not supported"),
    ({
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"]
    }, r"model_type 'mistral' \(MistralForCausalLM\) is not supported; supported: llama \(Llama 3.x\), qwen2"),
])
def test_config_fields_we_cannot_honour_are_refused_by_name(edit, message, tiny_hf, tmp_path):
  path = str(tmp_path / "m")
  shutil.copytree(tiny_hf("llama")[0], path)
  config = dict(json.load(open(os.path.join(path, "config.json"))), **edit)
  json.dump(config, open(os.path.join(path, "config.json"), "w"))
  with pytest.raises(HFModelError, match=message):
    from_hf(path)


def test_transformers_4_config_spelling_reads_the_same(tiny_hf, tmp_path):
  """Hub files written by transformers 4 carry rope_theta / rope_scaling / rope_local_base_freq."""
  path = tiny_hf("gemma3_text")[0]
  config = json.load(open(os.path.join(path, "config.json")))
  rope = config["rope_parameters"]
  legacy = dict(config, rope_theta=rope["full_attention"]["rope_theta"], torch_dtype="float32",
                rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling={
                    "rope_type": "linear",
                    "factor": rope["full_attention"]["factor"]
                })
  for key in ("rope_parameters", "layer_types", "dtype"):
    legacy.pop(key)
  legacy["sliding_window_pattern"] = 3
  from jaxrl_hex.models.families import config_from_hf
  assert config_from_hf(legacy) == config_from_hf(config)
