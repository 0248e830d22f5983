"""Direct sync within one host: the train side writes each version into the rollout layout's regions
in /dev/shm, the rollout side aliases them; a version is never overwritten while a live process holds it."""
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from support import ROOT

from jaxrl_hex.errors import UserError
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.sync import make_sync, shared_memory
from jaxrl_hex.sync.direct import SHARED, rollout_layouts

# One worker runs these: a writer's first segment unlinks every segment whose writer died, and
# a test that stages one (a dead writer's, for its receiver) lost it to another worker's writer.
pytestmark = pytest.mark.xdist_group("shared_memory")

MODEL = dict(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
CFG = model_config(**MODEL)


def _sides(pools, slots=shared_memory.SLOTS, **model):
  policy = Policy.build(model_config(**MODEL, **model))
  shapes, axes = policy.shapes(), policy.logical_axes()
  train_sh = pools["train"].shardings_for(axes, shapes)
  rollout_sh = pools["rollout"].shardings_for(axes, shapes)
  writer = make_sync("direct", shapes, None, layouts=rollout_layouts([pools["rollout"].spec], axes, shapes),
                     slots=slots)
  return policy, train_sh, writer, make_sync("direct", shapes, rollout_sh)


def _banks(writer):
  (banks,) = writer._writer.segments.values()
  return banks


def _pointers(params):
  return {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(params) for s in x.addressable_shards}


def _same(got, want):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["per-layer", "stacked"])
def test_versions_are_written_once_into_the_rollout_regions_and_used_where_they_lie(pools, scan_layers):
  policy, train_sh, writer, reader = _sides(pools, scan_layers=scan_layers)
  held = []
  for version in range(1, 4):
    params = policy.init(version, train_sh)
    handle = writer.publish(version, params)
    assert set(handle.payload) == {SHARED}  # nothing went through the object store
    got_version, got = reader.receive(handle)
    assert got_version == version
    _same(got, params)
    held.append((jax.device_get(params), got))
  for want, got in held:  # three versions alive at once: none overwrote another
    _same(got, want)
  (mapped,) = reader._segments.values()  # the rollout side's own mapping of the writer's segment
  start = mapped.slot_buffer(0).ctypes.data
  end = start + mapped.slots * mapped.slot_bytes
  got = held[-1][1]
  # every rollout device's buffer lies in the segment (no copy on the rollout side), one per region:
  # the replicas of a region (data=2, and the tensor axis on a norm) are one buffer
  assert all(start <= p < end for p in _pointers(got))
  assert len(_pointers(got)) == sum(len(leaf) for leaf in mapped.placed) < sum(
      len(x.addressable_shards) for x in jax.tree.leaves(got))
  rollout_sh = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), got, rollout_sh))
  path = os.path.join(shared_memory.DIRECTORY, mapped.name)
  writer.close()
  assert not os.path.exists(path)
  _same(got, held[-1][0])  # the mapping outlives the name while arrays use it


def test_held_versions_are_never_overwritten_and_a_superseded_one_gets_the_newest(pools, monkeypatch):
  policy, train_sh, writer, reader = _sides(pools, slots=2)
  params = lambda version: policy.init(version, train_sh)
  handles = {v: writer.publish(v, params(v)) for v in (1, 2)}
  held = {1: reader.receive(handles[1])[1]}
  handles[3] = writer.publish(3, params(3))  # into version 2's slot: the oldest no process holds
  version, held[3] = reader.receive(handles[2])  # version 2 is gone: the newest instead, as orbax's
  assert version == 3
  handles[4] = writer.publish(4, params(4))  # both slots held: a second segment
  assert len(_banks(writer)) == 2
  writer.publish(4, params(99))  # the same version again (no step since): already there, not rewritten
  held[4] = reader.receive(handles[4])[1]
  held[5] = reader.receive(writer.publish(5, params(5)))[1]
  monkeypatch.setattr(shared_memory, "BANKS", 2)
  writer._writer.timeout_s = 0.2
  with pytest.raises(
      UserError, match="version 6 waited 0.2 s for a free slot in shared memory: rollout processes "
      "hold all 4 versions kept"):
    writer.publish(6, params(6))
  for v, got in held.items():
    _same(got, params(v))
  del held[1]  # lets go of its slot, which version 6 then takes
  assert reader.receive(writer.publish(6, params(6)))[0] == 6
  for v, got in held.items():
    _same(got, params(v))
  writer.close()


# a rollout process: receives version 1 onto the rollout layout, prints its values' sum, holds them
RECEIVER = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
from jaxrl_hex import meshes
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.sync import make_sync
from jaxrl_hex.sync.handle import Handle
pools = meshes.build_pools(meshes.load_mesh_file("meshes/cpu-8.yaml"))
policy = Policy.build(model_config(**%r))
sh = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
_, got = make_sync("direct", policy.shapes(), sh).receive(Handle(1, %r))
print(sum(float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(got)), flush=True)
sys.stdin.read()
"""


def test_another_process_receives_and_a_killed_holder_does_not_block_the_writer(pools):
  policy, train_sh, writer, _ = _sides(pools, slots=2)
  params = policy.init(1, train_sh)
  handle = writer.publish(1, params)
  child = subprocess.Popen([sys.executable, "-c", RECEIVER % (MODEL, handle.payload)], cwd=ROOT,
                           env=dict(os.environ,
                                    PYTHONPATH=ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  total = float(child.stdout.readline())
  assert total == pytest.approx(sum(float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(params)))
  segment = _banks(writer)[0]
  assert [int(p) for p, slot in segment._holders if p] == [child.pid]
  child.send_signal(signal.SIGKILL)  # no finalizer runs: its entry stays, naming a dead pid
  child.wait()
  writer.publish(2, policy.init(2, train_sh))
  assert not segment._holders[:, 0].any()  # the dead holder's entry is gone
  writer.publish(3, policy.init(3, train_sh))  # into version 1's slot, which the dead process held
  assert len(_banks(writer)) == 1 and segment.slot_of(1) is None
  writer.close()


def test_a_killed_writer_s_segment_is_removed_by_the_next_writer(pools):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  stale = os.path.join(shared_memory.DIRECTORY, f"{shared_memory.PREFIX}{dead.pid}-0123456789ab")
  open(stale, "wb").close()
  policy, train_sh, writer, _ = _sides(pools)
  writer.publish(1, policy.init(1, train_sh))
  assert not os.path.exists(stale)
  assert os.path.exists(os.path.join(shared_memory.DIRECTORY, _banks(writer)[0].name))
  writer.close()


def test_tiles_are_the_regions_jax_lays_out(pools):
  policy = Policy.build(CFG)
  for pool in pools.values():
    for sharding, shape in zip(jax.tree.leaves(pool.shardings_for(policy.logical_axes(), policy.shapes())),
                               jax.tree.leaves(policy.shapes())):
      jax_regions = {
          tuple(s.indices(n)[:2] for s, n in zip(index, shape.shape))
          for index in sharding.devices_indices_map(shape.shape).values()
      }
      assert set(shared_memory.tiles(shape.shape, sharding.spec, dict(sharding.mesh.shape))) == jax_regions


def test_a_receiver_waits_for_the_write_and_learns_when_its_writer_died(pools):
  policy, train_sh, writer, reader = _sides(pools)
  writer.publish(1, policy.init(1, train_sh))
  segment = _banks(writer)[0]
  slot, _ = segment.claim()  # being written, by a process that then dies
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  orphan = f"{shared_memory.PREFIX}{dead.pid}-{segment.name.rsplit('-', 1)[1]}"
  os.link(os.path.join(shared_memory.DIRECTORY, segment.name), os.path.join(shared_memory.DIRECTORY, orphan))
  handle = writer.publish(1, policy.init(1, train_sh))
  with pytest.raises(UserError, match=f"the train process \\({dead.pid}\\) died while writing version 2"):
    reader.receive(handle._replace(version=2, payload={SHARED: {k: (orphan, slot) for k in handle.payload[SHARED]}}))
  os.unlink(os.path.join(shared_memory.DIRECTORY, orphan))
  writer.close()


def test_with_lora_the_adapters_and_the_base_each_go_through_shared_memory(tmp_path):
  """make_syncs on the train side: the rollout layouts of the adapters and of the frozen base (one
  slot: published once), split as the policy splits its params."""
  from support import load_config

  from jaxrl_hex.cluster.local import make_syncs
  from jaxrl_hex.runtime import build_runtime
  rt = build_runtime(load_config(**{"sync.method": "direct", "sync.transport": "shared_memory", "model.lora.rank": 4}))
  (writer, base_writer), (reader, base_reader) = (make_syncs(rt, str(tmp_path), receive) for receive in (False, True))
  params = rt.policy.init(0, rt.shardings("train"))
  adapters, base = rt.policy.split(params)
  assert all("_lora" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(adapters))
  for writes, reads, tree, version in ((base_writer, base_reader, base, 0), (writer, reader, adapters, 3)):
    handle = writes.publish(version, tree)
    assert set(handle.payload) == {SHARED}
    _same(reads.receive(handle)[1], tree)
  assert _banks(base_writer)[0].slots == 1 and _banks(writer)[0].slots == shared_memory.SLOTS
  writer.close()
  base_writer.close()
