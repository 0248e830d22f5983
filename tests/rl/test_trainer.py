"""The trainer end to end on the tiny model: layouts agree, steps update, state round-trips."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import load_config

from jaxrl_hex import meshes
from jaxrl_hex.models import lora
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy
from jaxrl_hex.rl.advantages import ADVANTAGES, AdvantageInputs
from jaxrl_hex.rl.aggregation import AGGREGATIONS
from jaxrl_hex.rl.batch import TrainBatch
from jaxrl_hex.rl.layout import TokenData, token_logprobs
from jaxrl_hex.rl.losses import LOSSES, LossInputs, behaviour_weight
from jaxrl_hex.rl.objectives import make_rl_loss
from jaxrl_hex.rl.trainer import Trainer, loaded_opt_state, make_optimizer, saved_opt_state

N, P, C = 16, 8, 6


@pytest.fixture(scope="module")
def setup():
  cfg = load_config()
  policy = Policy.build(model_config(**cfg.model))
  return policy, policy.init(0)


def _batch(seed=0):
  """Engine-layout batch with ragged prompts and completions, rewards in groups of 4."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 14, (N, P + C)).astype(np.int32)
  valid = np.zeros((N, P + C), bool)
  for i, (pl, cl) in enumerate(zip(rng.integers(3, P + 1, N), rng.integers(1, C + 1, N))):
    valid[i, P - pl:P] = valid[i, P:P + cl] = True
  loss_mask = valid[:, P:]
  return TrainBatch(tokens=tokens, valid=valid, loss_mask=loss_mask,
                    behav_logp=np.where(loss_mask, rng.uniform(-3.0, -2.0, (N, C)),
                                        0).astype(np.float32), rewards=rng.integers(0, 2, N).astype(np.float32),
                    group_ids=np.repeat(np.arange(N // 4), 4).astype(np.int32), versions=np.zeros((N, C), np.int32))


def _trainer(setup, pools, ref=False, **overrides):
  policy, params = setup
  cfg = load_config(**overrides)
  copy = lambda: jax.tree.map(lambda x: x.copy(), params)
  return Trainer(policy, pools["train"], make_optimizer(cfg.optim, 10), make_rl_loss(cfg.algo, 1.0), copy(),
                 ref_params=jax.tree.map(lambda x: x * 0.9, params) if ref else None)


def _rel(a, b):
  diff = jnp.sqrt(sum(jnp.sum((x - y)**2) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))
  return float(diff / jnp.sqrt(sum(jnp.sum(y**2) for y in jax.tree.leaves(b))))


def test_padded_layout_matches_a_direct_loss_on_engine_rows(setup, pools):
  """Independent path: token_logprobs on the engine layout, the loss registry, aggregation."""
  policy, params = setup
  batch = _batch()
  algo = load_config(**{"algo.loss_agg": "seq-mean-token-mean"}).algo

  def direct(p):
    logp, _ = token_logprobs(policy, p, batch)
    mask = jnp.asarray(batch.loss_mask, jnp.float32)
    logp = jnp.where(mask > 0, logp, 0.0)
    adv, _ = ADVANTAGES.get("grpo").fn(
        AdvantageInputs(
            jax.nn.one_hot(mask.sum(1).astype(jnp.int32) - 1, C) * batch.rewards[:, None], mask,
            jnp.asarray(batch.group_ids)), algo)
    inp = LossInputs.padded(logp, jax.lax.stop_gradient(logp), jnp.asarray(batch.behav_logp), adv, mask)
    inp.behav_weight, _ = behaviour_weight(inp, algo.behav_weight_cap, algo.behav_weight_mode)
    per_token, _ = LOSSES.get("ppo").fn(inp, algo)
    return (AGGREGATIONS.get("seq-mean-token-mean").fn(mask, algo) * per_token).sum()

  loss, grads = jax.value_and_grad(direct)(params)
  t_loss, t_grads = _trainer(setup, pools, **{"algo.loss_agg": "seq-mean-token-mean"}).gradients(batch)
  np.testing.assert_allclose(t_loss, loss, rtol=1e-5)
  assert _rel(t_grads, grads) <= 1e-5


@pytest.mark.parametrize("overrides", [
    {},
    {
        "algo.loss": "gspo",
        "algo.loss_agg": "seq-mean-token-mean",
        "algo.behav_weight_level": "sequence"
    },
    {
        "algo.loss": "cispo",
        "algo.loss_agg": "seq-mean-token-sum-norm",
        "algo.kl_coef": 0.1,
        "algo.entropy_coef": 0.01
    },
])
def test_packed_and_micro_batched_equal_padded_loss_and_grads(setup, pools, overrides):
  batch = _batch()
  ref = overrides.get("algo.kl_coef", 0) > 0
  loss, grads = _trainer(setup, pools, ref=ref, **overrides).gradients(batch)
  packed = {"algo.pack": True, "algo.pack_length": 32, "algo.micro_batch_tokens": 64}
  p_loss, p_grads = _trainer(setup, pools, ref=ref, **overrides, **packed).gradients(batch)
  assert abs(float(p_loss) - float(loss)) <= 1e-5 * abs(float(loss))
  assert _rel(p_grads, grads) <= 1e-5


def test_sequence_parallel_train_pool_gives_the_same_loss_and_grads(setup, pools):
  """rules {length: tensor}: packed rows' residual stream split over the sequence on the tensor devices."""
  spec = pools["train"].spec
  sp_pool = meshes.Pool(dataclasses.replace(spec, rules=dict(spec.rules, length=("tensor",))))
  packed = {"algo.pack": True, "algo.pack_length": 32, "algo.micro_batch_tokens": 64}
  loss, grads = _trainer(setup, pools, **packed).gradients(_batch())
  s_loss, s_grads = _trainer(setup, {"train": sp_pool}, **packed).gradients(_batch())
  assert abs(float(s_loss) - float(loss)) <= 1e-5 * abs(float(loss))
  assert _rel(s_grads, grads) <= 1e-5


def test_a_non_finite_loss_skips_the_update_and_counts_it(setup, pools):
  trainer = _trainer(setup, pools)
  before = jax.tree.map(np.asarray, trainer.state())
  bad = _batch()
  bad.rewards[:4] = np.nan  # one group: its advantages, so the loss
  m = trainer.step(bad)
  assert m["nonfinite_updates"] == 1.0 and trainer.version == 1
  for a, b in zip(jax.tree.leaves(trainer.state()), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  assert trainer.step(_batch())["nonfinite_updates"] == 0.0  # a finite batch updates again (Adam's moments;
  assert not all(
      np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trainer.state()["opt_state"]),
                                           jax.tree.leaves(before["opt_state"])))  # lr warms up from 0)


def test_shared_prompt_rows_equal_padded_loss_and_grads(setup, pools):
  """Each group's prompt computed once, its completions attending to it, gives the padded result."""
  batch = _batch()
  for start in range(0, N, 4):  # GRPO batches: the samples of a group share their prompt
    batch.tokens[start:start + 4, :P] = batch.tokens[start, :P]
    batch.valid[start:start + 4, :P] = batch.valid[start, :P]
  loss, grads = _trainer(setup, pools).gradients(batch)
  for packed in ({}, {"algo.pack": True, "algo.pack_length": 9}):  # packed: rows of 9 hold several completions
    s_loss, s_grads = _trainer(setup, pools, **{
        "algo.share_prompts": True,
        "algo.micro_batch_tokens": 48
    }, **packed).gradients(batch)
    assert abs(float(s_loss) - float(loss)) <= 1e-5 * abs(float(loss))
    assert _rel(s_grads, grads) <= 1e-5


def test_step_updates_params_and_reports_the_orchestrator_metrics(setup, pools):
  trainer = _trainer(setup, pools, ref=True, **{"algo.kl_coef": 0.05, "algo.pack": True, "algo.pack_length": 32})
  before = jax.tree.map(np.asarray, trainer.params)
  trainer.step(_batch())  # the schedule's warmup starts at lr 0
  m = trainer.step(_batch(1))
  assert trainer.version == 2
  assert {"loss", "kl", "clip_fraction", "entropy", "reward_mean", "grad_norm", "padding_share",
          "train_tokens_per_s"} <= set(m)
  assert m["kl"] > 0 and 0 <= m["padding_share"] < 0.5
  assert _rel(trainer.params, before) > 0


def test_minibatches_take_one_update_each_with_recomputed_or_interpolated_prox(setup, pools):
  batch = _batch()
  for prox in ("recompute", "interpolate"):
    trainer = _trainer(setup, pools, **{"algo.minibatches": 2, "algo.prox_logp": prox})
    m = trainer.step(batch)
    assert int(trainer.opt_state[1][0].count) == 2  # adamw saw two updates
    assert np.isfinite(m["loss"]) and m["behav_kept_fraction"] > 0


def test_interpolated_prox_logp_hand_computed():
  algo = load_config(**{"algo.prox_logp": "interpolate", "algo.minibatches": 2}).algo
  objective = make_rl_loss(algo, 1.0)
  micro = TokenData(weights=jnp.ones(2), loss_mask=jnp.ones(2), behav_logp=jnp.array([-2.0, -2.0]),
                    versions=jnp.array([3, 5]))
  logp = jnp.array([-1.0, -1.0])
  # token 0 is 2 versions = 4 updates old: alpha = 4 / (4 + m); token 1 is fresh: alpha = 0 after m = 0
  np.testing.assert_allclose(objective.proximal_logp(logp, micro, 1, 5), [-2.0 + 0.8, -2.0], rtol=1e-6)
  np.testing.assert_allclose(objective.proximal_logp(logp, micro, 0, 5), [-1.0, -1.0])


def test_ppo_critic_learns_and_its_state_round_trips(setup, pools):
  trainer = _trainer(setup, pools, **{"algo.advantage": "gae", "algo.critic.lr": 1e-2})
  batch = _batch()
  losses = [trainer.step(batch)["value_loss"] for _ in range(3)]
  assert losses[-1] < losses[0]
  state = trainer.state()
  assert set(state) == {"params", "opt_state", "critic"}
  head = np.asarray(state["critic"]["params"]["lm_head"])
  other = _trainer(setup, pools, **{"algo.advantage": "gae", "algo.critic.lr": 1e-2})
  other.load_state(state, 3)
  np.testing.assert_array_equal(other.critic_params["lm_head"], head)
  assert other.version == 3


def _adamw_as_before(optim, total_steps):
  """make_optimizer as it was, the schedule compiled into the update: what checkpoints hold."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, optim.lr, min(optim.warmup_steps, max(total_steps - 1, 1)),
                                                max(total_steps, 2), end_value=optim.lr * optim.end_lr_ratio)
  return optax.chain(optax.clip_by_global_norm(optim.grad_clip),
                     optax.adamw(schedule, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay))


@pytest.mark.parametrize("lr,warmup,steps,end", [(1e-3, 3, 8, 0.1), (3e-4, 0, 5, 1.0), (5e-4, 10, 1, 0.0)])
def test_optimizer_updates_as_optax_adamw_with_its_schedule_and_checkpoints_as_it(lr, warmup, steps, end):
  optim = load_config(**{"optim.lr": lr, "optim.warmup_steps": warmup, "optim.end_lr_ratio": end}).optim
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.ones(3)}
  new, old = make_optimizer(optim, steps), _adamw_as_before(optim, steps)
  new_state, old_state = new.init(params), old.init(params)
  for i in range(steps + 2):  # through the warmup, the decay and past its end
    grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)), params)
    new_updates, new_state = jax.jit(new.update)(grads, new_state, params)
    old_updates, old_state = jax.jit(old.update)(grads, old_state, params)
    jax.tree.map(np.testing.assert_array_equal, new_updates, old_updates)
  saved = saved_opt_state(new_state)
  assert jax.tree.structure(saved) == jax.tree.structure(old_state)  # old checkpoints restore as they are
  jax.tree.map(np.testing.assert_array_equal, saved, old_state)
  other = make_optimizer(load_config(**{"optim.lr": 2 * lr}).optim, steps + 10).init(params)
  resumed = loaded_opt_state(saved, other)  # the checkpoint's count and moments, the resuming run's schedule
  assert int(resumed[1][2].count) == steps + 2 and float(resumed[1][2].settings["lr"]) == np.float32(2 * lr)
  np.testing.assert_array_equal(resumed[1][0].mu["w"], new_state[1][0].mu["w"])


def test_runs_differing_in_lr_and_steps_share_one_update_program():
  params = {"w": jnp.ones((4, 3))}
  text = lambda tx: jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
  base = load_config().optim
  assert text(make_optimizer(base, 10)) == text(
      make_optimizer(load_config(**{
          "optim.lr": 1e-3,
          "optim.warmup_steps": 7,
          "optim.end_lr_ratio": 0.5
      }).optim, 500))


@pytest.fixture(scope="module")
def lora_setup(setup):
  """The tiny model with rank-4 adapters on its warm (here: random) weights."""
  cfg = load_config(**{"model.lora.rank": 4, "model.lora.alpha": 8.0})
  policy = Policy.build(model_config(**cfg.model))
  adapters = policy.init_adapters(0)
  return policy, lora.merge(adapters, setup[1])


def _lora_trainer(lora_setup, pools, **overrides):
  policy, params = lora_setup
  cfg = load_config(**{"optim.warmup_steps": 0, **overrides})
  return Trainer(policy, pools["train"], make_optimizer(cfg.optim, 10), make_rl_loss(cfg.algo, 1.0), params,
                 base_reference=cfg.algo.kl_coef > 0)


def test_lora_trains_only_the_adapters_with_the_base_as_the_kl_reference(lora_setup, pools):
  policy, params = lora_setup
  trainer = _lora_trainer(lora_setup, pools, **{"algo.kl_coef": 0.05})
  base = jax.tree.map(np.asarray, trainer.frozen)
  adapters = jax.tree.map(np.asarray, trainer.params)
  # the optimizer holds adapter moments only, and the published weights are the adapters
  assert jax.tree.structure(trainer.opt_state[1][0].mu) == jax.tree.structure(adapters)
  assert trainer.weights()[1] is trainer.params and "embed" not in trainer.params
  assert set(trainer.state()) == {"params", "opt_state"}  # no reference copy: it is the base
  first = trainer.step(_batch())
  assert first["kl"] == 0.0  # the adapters start as the identity: policy = reference, bit for bit
  second = trainer.step(_batch(1))
  assert second["kl"] > 0
  jax.tree.map(np.testing.assert_array_equal, trainer.frozen, base)  # the base never moves
  bs = [(np.asarray(a["b"]), b["b"]) for a, b in zip(jax.tree.leaves(trainer.params, is_leaf=lambda x: "b" in x),
                                                     jax.tree.leaves(adapters, is_leaf=lambda x: "b" in x))]
  assert all(np.abs(new - old).max() > 0 for new, old in bs)


def test_lora_gradients_equal_the_whole_models_gradients_on_the_adapters(lora_setup, pools):
  """Differentiating the adapters with the base closed over is the whole model's gradient, restricted."""
  policy, _ = lora_setup
  trainer = _lora_trainer(lora_setup, pools)
  loss, grads = trainer.gradients(_batch())
  whole = _lora_trainer(lora_setup, pools)  # the same model with every leaf trained: no frozen part
  whole.params, whole.frozen = whole.whole(), {}
  whole_loss, whole_grads = whole.gradients(_batch())
  assert abs(float(whole_loss) - float(loss)) <= 1e-6 * max(1.0, abs(float(loss)))
  assert _rel(grads, policy.split(whole_grads)[0]) <= 1e-5
  # the base has gradients the trainer never takes
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(policy.split(whole_grads)[1])) > 0


def test_lora_dropout_changes_the_update_but_not_the_start_pass(lora_setup, pools):
  cfg = load_config(**{"model.lora.rank": 4, "model.lora.alpha": 8.0, "model.lora.dropout": 0.3})
  policy, params = lora_setup
  # B nonzero (a fresh adapter adds zero, dropped or not)
  params = jax.tree_util.tree_map_with_path(lambda p, x: x + 0.05 if p[-1].key == "b" else x, params)
  dropped = Trainer(Policy.build(model_config(**cfg.model)), pools["train"], make_optimizer(cfg.optim, 10),
                    make_rl_loss(cfg.algo, 1.0), params)
  plain = _lora_trainer((policy, params), pools)
  batch = _batch()
  assert float(dropped.gradients(batch)[0]) != float(plain.gradients(batch)[0])
  np.testing.assert_array_equal(dropped.score(batch), plain.score(batch))  # scoring never drops
