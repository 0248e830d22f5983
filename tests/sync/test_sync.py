import jax
import numpy as np
import pytest

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.sync import device_put, direct, make_sync, regions
from jaxrl_hex.sync.handle import Handle

CFG = model_config(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)


def assert_same_values(got, want):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("method", ["device_put", "orbax"])
def test_resharding_preserves_every_value(pools, method, tmp_path):
  policy = Policy.build(CFG)
  train_sh = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
  rollout_sh = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  sync = make_sync(method, policy.shapes(), rollout_sh, str(tmp_path / "sync"))
  for version in (1, 2, 3, 4):
    params = policy.init(version, train_sh)
    handle = sync.publish(version, params)
    got_version, got = sync.receive(handle)
    assert got_version == version == handle.version
    assert_same_values(got, params)
    # every received leaf sits on the rollout pool's devices, in the rollout layout
    assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), got, rollout_sh))
    assert {d.id for x in jax.tree.leaves(got) for d in x.sharding.device_set} == {4, 5, 6, 7}
  if method == "orbax":  # old versions are deleted, the newest kept; a superseded handle gets the newest
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v00000002", "v00000003", "v00000004"]
    assert sync.receive(Handle(1))[0] == 4


def test_direct_sync_through_the_object_store(pools, ray_session, monkeypatch):
  policy = Policy.build(CFG)
  train_sh = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
  rollout_sh = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  params = policy.init(3, train_sh)
  handle = make_sync("direct", policy.shapes()).publish(7, params)
  # the train layout splits wq (64, 4, 8) over fsdp=2 x tensor=2: four distinct shards, no copies
  assert len(handle.payload["['layers'][0]['attn']['wq']"]) == 4
  version, got = make_sync("direct", policy.shapes(), rollout_sh).receive(handle)
  assert version == 7
  assert_same_values(got, params)
  # a rollout region of wq is two fsdp shards stacked on the first axis, which publish put back to
  # back: it is used where it lies in the object store, not copied out
  import ray
  (first, (ref, i)), = [(b, at) for b, at in handle.payload["['layers'][0]['attn']['wq']"] if b[:2] == ((0, 16), (0, 2))
                       ]
  wq = got["layers"][0]["attn"]["wq"]
  assert ray.get(ref)[i].ctypes.data in {s.data.unsafe_buffer_pointer() for s in wq.addressable_shards}
  assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), got, rollout_sh))
  refs = lambda h: {ref for shards in h.payload.values() for _, (ref, _) in shards}
  assert len(refs(handle)) == 1  # a small model is one object-store put
  # chunks smaller than a shard: one object per shard, and the values still arrive whole
  monkeypatch.setattr(direct, "CHUNK_BYTES", 1)
  handle = make_sync("direct", policy.shapes()).publish(8, params)
  assert len(refs(handle)) == sum(len(shards) for shards in handle.payload.values())
  assert_same_values(make_sync("direct", policy.shapes(), rollout_sh).receive(handle)[1], params)


def test_unwritable_sync_directory_is_refused(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(UserError, match="sync.directory: cannot write"):
    make_sync("orbax", {}, None, str(blocker / "sync"))


def _layouts(pools):
  policy = Policy.build(CFG)
  return (policy, pools["train"].shardings_for(policy.logical_axes(), policy.shapes()),
          pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes()))


@pytest.mark.parametrize("host", [True, False], ids=["host-assembled", "device-to-device"])
def test_a_published_version_keeps_its_values_after_later_steps_donate_the_params(pools, host, monkeypatch):
  if not host:  # the accelerators' path: an async device_put the runtime orders before the donation
    monkeypatch.setattr(device_put, "_on_cpu", lambda _: False)
  policy, train_sh, rollout_sh = _layouts(pools)
  sync = make_sync("device_put", policy.shapes(), rollout_sh)
  step = jax.jit(lambda p: jax.tree.map(lambda x: x * 2 + 1, p), donate_argnums=0, out_shardings=train_sh)
  params = policy.init(1, train_sh)
  want = jax.device_get(params)
  handle = sync.publish(1, params)
  for _ in range(3):  # as LocalTrainSide.step: a publish's copy still running ends before the donation
    sync.settle()
    params = step(params)
  assert_same_values(sync.receive(handle)[1], want)


def test_host_assembled_versions_share_replicas_and_never_overwrite_a_held_one(pools):
  policy, train_sh, rollout_sh = _layouts(pools)
  sync = make_sync("device_put", policy.shapes(), rollout_sh)
  held = []  # (params published, params received): all alive at once, as an engine's and the next
  for version in range(1, 7):
    params = policy.init(version, train_sh)
    held.append((jax.device_get(params), sync.receive(sync.publish(version, params))[1]))
  for want, got in held:
    assert_same_values(got, want)
  # data=2 replicates every leaf: both replicas of a region are one host buffer (one copy, not two)
  wq = held[-1][1]["layers"][0]["attn"]["wq"]
  pointers = {}
  for shard in wq.addressable_shards:
    pointers.setdefault(regions.bounds(shard.index, wq.shape), set()).add(shard.data.unsafe_buffer_pointer())
  assert len(pointers) == 2 and all(len(p) == 1 for p in pointers.values())


def test_direct_sync_of_stacked_layers_uses_the_object_store_in_place(pools, ray_session, monkeypatch):
  """model.scan_layers: wq [L, d, h, hd] is split over fsdp on d, so a rollout region (h over tensor)
  joins two shards along axis 1; publish puts them layer by layer, so the region still lies whole
  in the object store. Small slices are not cut (SLICE_BYTES)."""
  policy = Policy.build(model_config(**dict(CFG, scan_layers=True)))
  train_sh = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
  rollout_sh = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  params = policy.init(5, train_sh)
  key = "['layers']['attn']['wq']"
  monkeypatch.setattr(direct, "SLICE_BYTES", 1)
  handle = make_sync("direct", policy.shapes()).publish(1, params)
  assert len(handle.payload[key]) == 4 * CFG.n_layers  # 4 shards, each cut at each layer
  got = make_sync("direct", policy.shapes(), rollout_sh).receive(handle)[1]
  assert_same_values(got, params)
  import ray
  stored = {ray.get(ref)[i].ctypes.data for _, (ref, i) in handle.payload[key]}
  assert {s.data.unsafe_buffer_pointer() for s in got["layers"]["attn"]["wq"].addressable_shards} <= stored
  monkeypatch.setattr(direct, "SLICE_BYTES", 1 << 20)  # this model's slices are far below that
  handle = make_sync("direct", policy.shapes()).publish(2, params)
  assert len(handle.payload[key]) == 4
  assert_same_values(make_sync("direct", policy.shapes(), rollout_sh).receive(handle)[1], params)
