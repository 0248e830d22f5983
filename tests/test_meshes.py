import os

import numpy as np
import pytest
from support import ROOT

from jaxrl_hex import meshes
from jaxrl_hex.meshes import MeshError


def _write(tmp_path, text):
  path = tmp_path / "m.yaml"
  path.write_text(text)
  return str(path)


def test_cpu8_pools_have_different_layouts(pools):
  assert pools["train"].axis_sizes == {"fsdp": 2, "tensor": 2}
  assert pools["rollout"].axis_sizes == {"data": 2, "tensor": 2}
  assert {d.id for d in pools["train"].devices}.isdisjoint({d.id for d in pools["rollout"].devices})
  assert pools["train"].batch_ways == 2 and pools["rollout"].batch_ways == 2


def test_rules_table_maps_logical_axes_and_drops_missing_mesh_axes(pools):
  assert tuple(pools["train"].partition_spec(("vocab_in", "embed_in"))) == ("tensor", "fsdp")
  assert tuple(pools["rollout"].partition_spec(("vocab_in", "embed_in"))) == ("tensor", None)
  assert tuple(pools["rollout"].partition_spec(("batch", "length"))) == ("data", None)


def test_a_new_layout_is_a_new_table(tmp_path):
  path = _write(
      tmp_path, "num_devices: 8\npools:\n  train:\n    devices: 4\n    mesh: {fsdp: 4}\n"
      "    rules: {vocab: fsdp, embed: null}\n  rollout: {devices: 4, mesh: {data: 4}}\n")
  pool = meshes.build_pools(meshes.load_mesh_file(path))["train"]
  assert tuple(pool.partition_spec(("vocab_in", "embed_in"))) == ("fsdp", None)


def test_each_use_of_the_model_dimension_has_its_own_rule(tmp_path):
  """The embedding table can stay whole while the projections shard (one name per use)."""
  path = _write(
      tmp_path, "num_devices: 8\npools:\n  train:\n    devices: 4\n    mesh: {fsdp: 4}\n"
      "    rules: {embed_in: null, vocab_out: fsdp, embed_out: null}\n  rollout: {devices: 4, mesh: {data: 4}}\n")
  pool = meshes.build_pools(meshes.load_mesh_file(path))["train"]
  assert tuple(pool.partition_spec(("vocab_in", "embed_in"))) == (None, None)
  assert tuple(pool.partition_spec(("qkv_embed", "heads", "head_dim"))) == ("fsdp", None, None)
  assert tuple(pool.partition_spec(("embed_out", "vocab_out"))) == (None, "fsdp")


def test_a_mesh_axis_used_twice_in_one_array_is_refused(tmp_path):
  path = _write(
      tmp_path, "num_devices: 8\npools:\n  train:\n    devices: 4\n    mesh: {fsdp: 2, tensor: 2}\n"
      "    rules: {mlp: fsdp}\n  rollout: {devices: 4, mesh: {data: 4}}\n")
  pool = meshes.build_pools(meshes.load_mesh_file(path))["train"]
  with pytest.raises(MeshError, match=r"pools.train: w1 dims 0 \('mlp_up_embed'\) and 1 \('mlp'\) both map to "
                     "mesh axis 'fsdp'"):
    pool.partition_spec(("mlp_up_embed", "mlp"), what="w1")
  with pytest.raises(MeshError, match=r"pools.train.rules.embeding: unknown logical axis"):
    meshes.load_mesh_file(_write(tmp_path, "pools:\n  train: {devices: 4, mesh: {fsdp: 4}, rules: {embeding: null}}\n"))


def test_bad_mesh_files_name_the_field(tmp_path):
  with pytest.raises(MeshError, match=r"pools.train.mesh: mesh \{'fsdp': 3\} has 3 devices but the pool lists 4"):
    meshes.load_mesh_file(_write(tmp_path, "pools:\n  train: {devices: 4, mesh: {fsdp: 3}}\n"))
  with pytest.raises(MeshError, match="unknown axes"):
    meshes.load_mesh_file(_write(tmp_path, "pools:\n  train: {devices: 2, mesh: {model: 2}}\n"))
  with pytest.raises(MeshError, match="share devices"):
    meshes.load_mesh_file(
        _write(
            tmp_path, "pools:\n  train: {devices: [0, 1], mesh: {fsdp: 2}}\n"
            "  rollout: {devices: [1, 2], mesh: {data: 2}}\n"))
  with pytest.raises(MeshError, match="does not exist"):
    meshes.load_mesh_file(str(tmp_path / "missing.yaml"))


def test_pool_beyond_the_devices_and_dims_that_do_not_divide(tmp_path, pools):
  spec = meshes.load_mesh_file(_write(tmp_path, "pools:\n  train: {devices: [6, 7, 8, 9], mesh: {fsdp: 4}}\n"))
  with pytest.raises(MeshError, match="only 8 cpu devices exist"):
    meshes.build_pools(spec)
  with pytest.raises(MeshError, match=r"dim 0 \('heads', size 3\) does not divide over mesh axes \('tensor',\)"):
    pools["train"].partition_spec(("heads", "qkv_embed"), shape=(3, 64))


MESH_FILES = sorted(f for f in os.listdir(os.path.join(ROOT, "meshes")) if not f.startswith("cluster-"))


@pytest.mark.parametrize("name", MESH_FILES)
def test_every_shipped_mesh_file_loads(name):
  spec = meshes.load_mesh_file(os.path.join(ROOT, "meshes", name))
  assert {"train", "rollout"} <= set(spec.pools)
  for pool in spec.pools.values():
    layouts = [(g.count, g.axes) for g in pool.groups] or [(1, pool.axes)]
    assert sum(count * int(np.prod(list(axes.values()))) for count, axes in layouts) == len(pool.device_ids)


def test_one_device_shared_by_both_pools(tmp_path):
  pools = meshes.build_pools(meshes.load_mesh_file(os.path.join(ROOT, "meshes", "single.yaml")))
  assert pools["train"].devices == pools["rollout"].devices


def test_relayouts_fold_the_tensor_degree_into_the_pools_batch_axis_nearest_first(pools):
  train, rollout = pools["train"].spec, pools["rollout"].spec
  assert [s.axes for s in meshes.relayouts(train)] == [{"fsdp": 4}, {"fsdp": 2, "data": 2}]
  assert [s.axes for s in meshes.relayouts(rollout)] == [{"data": 4}, {"data": 2, "fsdp": 2}]
  wide = meshes.PoolSpec("train", tuple(range(8)), {"fsdp": 2, "tensor": 4}, meshes.DEFAULT_RULES)
  assert [s.axes for s in meshes.relayouts(wide)][:2] == [{"fsdp": 4, "tensor": 2}, {"fsdp": 2, "data": 2, "tensor": 2}]
  assert meshes.relayouts(meshes.PoolSpec("train", (0, 1), {"fsdp": 2}, meshes.DEFAULT_RULES)) == []
  assert meshes.format_axes(train.axes) == "{fsdp: 2, tensor: 2}"


def test_shipped_mesh_files_are_the_one_runtime_files_of_the_platform_then_any():
  names = [path for path, _ in meshes.shipped_mesh_files("cpu")]
  assert names[0] == "meshes/cpu-1-1.yaml" and names[-1] == "meshes/single.yaml"
  assert "meshes/cpu-8.yaml" in names and not {"meshes/cpu-ray.yaml", "meshes/cpu-mixed.yaml"} & set(names)
  assert not any(n.startswith(("meshes/cluster-", "meshes/plan-")) for n in names)
