import jax
import numpy as np
import pytest

from jaxrl_hex.models import Policy
from jaxrl_hex.models.config import model_config
from jaxrl_hex.sync import make_sync

CFG = model_config(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)


@pytest.mark.parametrize("method", ["device_put", "orbax"])
def test_resharding_preserves_every_value(pools, method, tmp_path):
  policy = Policy.build(CFG)
  train_sh = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
  rollout_sh = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  sync = make_sync(method, rollout_sh, policy.shapes(), str(tmp_path / "sync"))
  for version in (1, 2, 3):
    params = policy.init(version, train_sh)
    sync.publish(version, params)
    got_version, got = sync.receive()
    assert got_version == version == sync.latest_version()
    for path, leaf in jax.tree_util.tree_leaves_with_path(got):
      want = params
      for k in path:
        want = want[k.key]
      np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    # every received leaf sits on the rollout pool's devices, in the rollout layout
    assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), got, rollout_sh))
    assert {d.id for x in jax.tree.leaves(got) for d in x.sharding.device_set} == {4, 5, 6, 7}
  if method == "orbax":  # old versions are deleted, the newest kept
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v00000002", "v00000003"]


def test_wait_for_blocks_until_the_version_is_published(pools):
  policy = Policy.build(CFG)
  rollout_sh = pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes())
  sync = make_sync("device_put", rollout_sh, policy.shapes(), "")
  assert not sync.wait_for(1, timeout=0.01)
  sync.publish(1, policy.init(0, rollout_sh))
  assert sync.wait_for(1, timeout=0.01)
