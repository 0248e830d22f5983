"""LoRA weights on the rollout side: the base arrives once, the adapters every version, and the
engine computes the trainer's logprobs with them unmerged or merged."""
import jax
import numpy as np
import pytest

from jaxrl_hex.models import lora
from jaxrl_hex.models.config import lora_weight_dims, model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.models.tokenizer import CharTokenizer
from jaxrl_hex.rl.batch import rl_batch
from jaxrl_hex.rl.layout import token_logprobs
from jaxrl_hex.rollout.engine import Engine
from jaxrl_hex.sync import make_sync
from jaxrl_hex.sync.adapters import AdapterWeights

CFG = model_config(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                   tie_embeddings=True, lora=dict(rank=4, alpha=8.0))
TOK = CharTokenizer("0123456789+=")
PROMPTS = ["1+2=", "47+38=", "5=", "99+99+9="]


def _version(policy, adapters, v):
  """The adapters of version v: B moved off zero, so they change the model."""
  return jax.tree_util.tree_map_with_path(lambda p, x: x + 0.03 * v if p[-1].key == "b" else x, adapters)


@pytest.fixture(scope="module")
def trained(pools):
  """(policy, train-pool shardings, base, adapters of version 1) on the train pool."""
  policy = Policy.build(CFG)
  shardings = pools["train"].shardings_for(policy.logical_axes(), policy.shapes())
  adapters, base = policy.split(policy.init(0, shardings))
  return policy, base, _version(policy, adapters, 1)


def _rollout_side(policy, pools, method, directory, serving):
  shapes = policy.split(policy.shapes())
  targets = policy.split(pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes()))
  syncs = [make_sync(method, s, t, str(directory / name)) for s, t, name in zip(shapes, targets, ("v", "base"))]
  weights = AdapterWeights(policy, pools["rollout"].shardings_for(policy.logical_axes(), policy.shapes()), serving)
  return syncs, weights


@pytest.mark.parametrize("serving", ["unmerged", "merged"])
@pytest.mark.parametrize("method", ["device_put", "orbax"])
def test_engine_logprobs_equal_the_trainers_with_adapters(trained, pools, tmp_path, method, serving):
  policy, base, adapters = trained
  (sync, base_sync), weights = _rollout_side(policy, pools, method, tmp_path, serving)
  handle = sync.publish(1, adapters)._replace(base=base_sync.publish(0, base))
  assert weights.needs_base(handle)
  weights.set_base(handle.base, base_sync.receive(handle.base)[1])
  assert not weights.needs_base(handle)
  version, received = sync.receive(handle)
  params = weights.assemble(version, received)
  assert weights.assemble(version, received) is params  # the eval engine shares the first engine's copy
  assert ("wq_lora" in params["layers"][0]["attn"]) == (serving == "unmerged")
  engine = Engine(weights.engine_policy, pools["rollout"], TOK, max_new_tokens=8, temperature=1.3)
  engine.load_weights(version, params)
  rollout = engine.generate(PROMPTS, 4, jax.random.key(0))
  rollout.rewards = np.zeros(len(rollout.group_ids), np.float32)
  logp, _ = jax.jit(lambda p, b: token_logprobs(policy, p, b, temperature=1.3))(lora.merge(adapters, base),
                                                                                rl_batch(rollout))
  mask = rollout.completion_mask
  assert mask.sum() > 20
  assert np.abs(np.asarray(logp)[mask] - rollout.behaviour_logprobs[mask]).max() <= 1e-4
  # the adapters change the model: the base alone scores these tokens differently
  base_logp, _ = jax.jit(lambda p, b: token_logprobs(policy.base(), p, b, temperature=1.3))(base, rl_batch(rollout))
  assert np.abs(np.asarray(base_logp)[mask] - rollout.behaviour_logprobs[mask]).max() > 1e-3


def test_a_new_version_moves_only_the_adapters_and_switches_mid_generation(trained, pools, tmp_path):
  policy, base, adapters = trained
  (sync, base_sync), weights = _rollout_side(policy, pools, "device_put", tmp_path, "merged")
  base_handle = base_sync.publish(0, base)
  weights.set_base(base_handle, base_sync.receive(base_handle)[1])
  # what a version moves: (in + out) x rank fp32 numbers per adapted projection and layer
  per_layer = sum(i + o for i, o in lora_weight_dims(CFG).values())
  assert sum(x.nbytes for x in jax.tree.leaves(adapters)) == CFG.n_layers * per_layer * 4 * 4
  engine = Engine(weights.engine_policy, pools["rollout"], TOK, max_new_tokens=8, temperature=1.3, steps_per_sync=2)
  engine.load_weights(1, weights.assemble(*sync.receive(sync.publish(1, adapters))))
  second = _version(policy, adapters, 2)
  switched = []

  def source():  # the new adapters arrive after the first hand-back, mid-generation
    if not switched:
      switched.append(True)
      return None
    if len(switched) == 1:
      switched.append(True)
      return 2, weights.assemble(*sync.receive(sync.publish(2, second)))
    return None

  engine.weights_source = source
  rollout = engine.generate(PROMPTS, 2, jax.random.key(1))
  versions = rollout.versions[rollout.completion_mask]
  assert set(np.unique(versions)) == {1, 2}  # every token carries the weights that sampled it
  assert weights.adapters[0] == 2 and weights.base is not None
