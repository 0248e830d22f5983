"""jaxrl_hex.footprint on the demo's model: XLA's per-device bytes of the real train and decode
programs, compiled on abstract state, against the bytes the pool's shardings hold; the preflight's
refusal of a layout that does not fit."""
import os

import jax
import ml_collections
import pytest
from jax.sharding import PartitionSpec as P
from support import ROOT, load_config

from jaxrl_hex import footprint, meshes
from jaxrl_hex.errors import UserError
from jaxrl_hex.models.config import model_config, param_count
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.planner.catalog import load_catalog
from jaxrl_hex.rl.objectives import make_rl_loss
from jaxrl_hex.rl.trainer import Trainer, make_optimizer
from jaxrl_hex.runtime import build_runtime

TRAIN_MESH = {"fsdp": 2, "tensor": 2}  # meshes/cpu-8.yaml's train pool


def _cfg(**overrides):
  cfg = load_config(**overrides)
  cfg.model.vocab_size = 16
  return cfg


@pytest.fixture(scope="module")
def setup(pools):
  cfg = _cfg()
  policy = Policy.build(model_config(**cfg.model))
  objective, tx = make_rl_loss(cfg.algo, cfg.rollout.temperature), make_optimizer(cfg.optim, 10)
  return cfg, policy, objective, tx


def _per_device_params(cfg) -> int:
  """The demo model's params one device of the (fsdp 2, tensor 2) pool holds: every matrix split
  four ways, the RMSNorm scales (two per layer and the final one, d_model each) whole."""
  norms = (2 * cfg.n_layers + 1) * cfg.d_model
  return (param_count(cfg) - norms) // 4 + norms


def test_train_step_arguments_are_the_sharded_state_and_the_layout(pools, setup):
  cfg, policy, objective, tx = setup
  batch = footprint.full_batch(32, 8, 8, group_size=8)
  step = footprint.train_step(policy, pools["train"], objective, tx, batch)
  assert step["layout"] == (1, 1, 32, 16)
  # params, Adam's mu and nu in fp32, two int32 step counts (adam's and the schedule's) and the
  # schedule's four fp32 settings
  state = 3 * _per_device_params(policy.cfg) * 4 + 2 * 4 + 4 * 4
  assert state == 375576
  assert footprint.sharded_bytes((step["state"].params, step["state"].opt_state)) == state
  update = step["update"]
  # the rest: the Rows fields a token-level loss reads (tokens, positions, segments; `seq` and the
  # version are pruned), [32, 16] int32 split over fsdp; the 5 fp32 TokenData fields whole on every
  # device (the start pass's outputs, whose shardings XLA picks); the minibatch index
  shard, whole = 16 * 16 * 4, 32 * 16 * 4
  assert update.argument_bytes == state + 3 * shard + 5 * whole + 4
  assert update.alias_bytes == state  # the donated state is updated in place
  assert update.output_bytes >= state
  assert update.temp_bytes > 0 and update.compile_seconds > 0
  assert update.peak_bytes == update.argument_bytes + update.output_bytes + update.temp_bytes - update.alias_bytes


def test_micro_batches_shrink_the_update_s_temporaries_to_one_micro_batch_s(pools, setup):
  """Every micro-batch runs in the accumulation loop, so a step's temporaries are one micro-batch's:
  two micro-batches need about half a whole batch's (the first run before the loop once took a
  block as large as the whole batch's beside the loop's)."""
  cfg, policy, _, tx = setup
  batch = footprint.full_batch(64, 32, 32, group_size=8)
  temps = {}
  for tokens in (0, 2048, 1024):
    algo = dict(cfg.algo, micro_batch_tokens=tokens)
    objective = make_rl_loss(ml_collections.ConfigDict(algo), cfg.rollout.temperature)
    step = footprint.train_step(policy, pools["train"], objective, tx, batch)
    temps[step["layout"][1]] = step["update"].temp_bytes  # by micro-batches K
  assert set(temps) == {1, 2, 4}
  assert temps[2] < 0.6 * temps[1] and temps[4] < 0.6 * temps[2]


def test_abstract_optimizer_state_is_where_the_trainer_puts_it(pools, setup):
  cfg, policy, objective, tx = setup
  pool = pools["train"]
  state = footprint.train_state(policy, pool, tx, objective)
  trainer = Trainer(policy, pool, tx, objective,
                    policy.init(0, pool.shardings_for(policy.logical_axes(), policy.shapes())))
  assert jax.tree.map(lambda x: x.sharding, trainer.opt_state) == jax.tree.map(lambda x: x.sharding, state.opt_state)
  moments = trainer.opt_state[1][0].mu
  assert moments["embed"].sharding.spec == trainer.params["embed"].sharding.spec == P("tensor", "fsdp")
  # Adam's two moments, two int32 counts and the learning-rate schedule's four fp32 settings
  assert footprint.sharded_bytes(state.opt_state) == 2 * _per_device_params(policy.cfg) * 4 + 2 * 4 + 4 * 4


def test_decode_step_arguments_are_the_weights_and_the_kv_cache(pools, setup):
  cfg, policy, _, _ = setup
  pool = pools["rollout"]  # (data 2, tensor 2), vocab replicated
  decode = footprint.decode_step(policy, pool, 8, slots=32, max_prompt_len=16, steps_per_sync=4)
  m = policy.cfg
  # keys and values [slots / data, length, kv_heads / tensor, head_dim] per layer, fp32
  cache = 2 * m.n_layers * (32 // 2) * (16 + 8) * (m.n_kv_heads // 2) * m.head_dim * 4
  params = footprint.sharded_bytes(
      footprint.abstract(policy.shapes(),
                         meshes.Pool(pool.spec).shardings_for(policy.logical_axes(), policy.shapes())))
  assert cache == 98304
  assert decode.argument_bytes > params + cache
  assert decode.alias_bytes >= cache  # the cache is donated and written in place
  assert decode.peak_bytes < decode.argument_bytes + decode.output_bytes + decode.temp_bytes
  # paged: a pool of 64 blocks of 4 tokens [blocks / data, kv_heads / tensor, ...] per layer, fp32
  paged = footprint.decode_step(policy, pool, 8, slots=32, max_prompt_len=16, steps_per_sync=4, kv_page_size=4,
                                kv_blocks=64)
  pool_bytes = 2 * m.n_layers * (64 // 2) * 4 * (m.n_kv_heads // 2) * m.head_dim * 4
  tables = (32 // 2) * (24 // 4) * 4  # [slots / data, blocks per slot] int32
  assert pool_bytes == cache // 3
  assert paged.argument_bytes > params + pool_bytes + tables
  assert paged.alias_bytes >= pool_bytes


def _tiny_catalog(hbm_gb):
  fields = dict(platform="cpu", bf16_tflops=1, hbm_gb=hbm_gb, hbm_gb_s=1, link_gb_s=1, host_net_gb_s=1,
                price_per_hour=0, chips_per_host=8)
  return load_catalog([("inline", {"devices": {"tiny-chip": fields}})])


def _pool_of_type(pools, device_type):
  spec = pools["train"].spec
  return meshes.Pool(meshes.PoolSpec(spec.name, spec.device_ids, spec.axes, spec.rules, device_type))


def test_preflight_refuses_a_step_that_does_not_fit_in_one_line(pools, setup):
  cfg, policy, _, _ = setup
  with pytest.raises(UserError) as e:
    footprint.preflight(cfg, policy, _pool_of_type(pools, "tiny-chip"), _tiny_catalog(1e-4))
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith("pools.train: the compiled train step needs ")
  assert "per device but a device has 0.00 GiB (catalog hbm_gb of device_type tiny-chip)" in message
  # 32 prompts x 8 samples, each of max_prompt_len 64 + max_new_tokens 6 tokens
  assert "lower algo.micro_batch_tokens (now 1 micro-batch(es) of 256 rows x 70 tokens)" in message
  assert "set model.remat='full', set model.scan_layers=True" in message
  assert "split the sequence over tensor (pools.train.rules: {length: tensor})" in message
  assert "give pools.train.mesh more fsdp (now {'fsdp': 2, 'tensor': 2})" in message


def test_preflight_passes_what_fits_and_skips_an_unknown_device(pools, setup):
  cfg, policy, objective, tx = setup
  figures = footprint.preflight(cfg, policy, _pool_of_type(pools, "tiny-chip"), _tiny_catalog(1.0))
  assert figures["capacity_bytes"] == 10**9
  assert figures["layout"] == (1, 1, 256, 70)
  batch = footprint.full_batch(256, 64, 6, group_size=8)
  assert figures["needed_bytes"] == footprint.train_step(policy, pools["train"], objective, tx,
                                                         batch)["update"].peak_bytes
  assert footprint.preflight(cfg, policy, pools["train"]) is None  # cpu-8.yaml names no device type


def test_the_train_pool_of_a_runtime_is_checked_when_built(tmp_path, monkeypatch):
  mesh = open(os.path.join(ROOT, "meshes", "cpu-8.yaml")).read()
  mesh = mesh.replace("  train:\n", "  train:\n    device_type: tiny-chip\n")
  path = tmp_path / "mesh.yaml"
  path.write_text(mesh)
  cfg = _cfg()
  cfg.mesh_file = str(path)
  rt = build_runtime(cfg)
  monkeypatch.setattr(footprint, "load_catalog", lambda: _tiny_catalog(1e-4))
  rt.pool("rollout")  # only the train pool is checked
  with pytest.raises(UserError, match=r"^pools.train: the compiled train step needs .* device_type tiny-chip\)"):
    rt.pool("train")


def test_the_trainer_runs_the_programs_the_preflight_compiled(pools, setup, caplog):
  """The preflight's start pass and update are the trainer's own programs: with JAX's persistent
  compilation cache (runtime.enable_compile_cache; this suite's is tests/conftest.py's) the
  trainer's first step at the largest layout loads them instead of compiling them again."""
  import logging
  cfg, policy, _, _ = setup
  pool = _pool_of_type(pools, "tiny-chip")
  footprint.preflight(cfg, policy, pool, _tiny_catalog(1.0))
  objective = make_rl_loss(cfg.algo, cfg.rollout.temperature)
  tx = make_optimizer(cfg.optim, cfg.train.steps * cfg.algo.minibatches)  # as the run's trainer (cluster/local.py)
  params = policy.init(0, pool.shardings_for(policy.logical_axes(), policy.shapes()))
  trainer = Trainer(policy, pool, tx, objective, params, ref_params=params if cfg.algo.kl_coef > 0 else None)
  with caplog.at_level(logging.DEBUG, logger="jax._src.compiler"):
    trainer.step(footprint.full_batch(256, 64, 6, group_size=8))
  logged = lambda event: [
      r.getMessage() for r in caplog.records
      if any(f"{event} '{name}'" in r.getMessage() for name in ("jit_start", "jit__update"))
  ]
  hits, misses = logged("Persistent compilation cache hit for"), logged("CACHE MISS for")
  assert len(hits) == 2 and not misses, (hits, misses)  # the start pass and the update
