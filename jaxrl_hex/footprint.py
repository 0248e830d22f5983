"""Per-device memory of the programs a run compiles, from XLA itself: the trainer's update of one
minibatch (and its start pass) and the engine's decode step, lowered and compiled for a pool on
abstract params and optimizer state (ShapeDtypeStructs carrying the pool's shardings), so no
weight is allocated and a 70B layout compiles on a laptop's simulated devices.

`compiled.memory_analysis()` reports per-device buffer sizes of the SPMD program: arguments,
outputs, temporaries, outputs aliased to donated arguments and generated code. A program's peak is
about argument + output + temp - alias (donated state is updated in place). XLA:CPU fuses and
schedules differently from TPU and GPU, so its figures are a proxy for theirs, not equal to them.

`preflight` refuses, with one line, a train layout whose compiled step does not fit the pool's
device memory (the device's own limit where it reports one, else the catalog's HBM of the pool's
device type), before any weight is loaded.
"""
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hex.data.rollouts import bucket
from jaxrl_hex.errors import UserError
from jaxrl_hex.meshes import local_device
from jaxrl_hex.models import lora
from jaxrl_hex.planner.catalog import load_catalog
from jaxrl_hex.rl.batch import TrainBatch
from jaxrl_hex.rl.objectives import StartInputs, make_rl_loss
from jaxrl_hex.rl.trainer import (
    critic_model,
    layout_of,
    make_optimizer,
    optimizer_shardings,
    start_program,
    step_inputs,
    update_program,
)
from jaxrl_hex.rollout.engine import Engine


@dataclasses.dataclass(frozen=True)
class Program:
  """One compiled program's per-device bytes (compiled.memory_analysis()) and compile time."""
  name: str
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  code_bytes: int
  compile_seconds: float

  @property
  def peak_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), peak_bytes=self.peak_bytes)


def compile_program(name: str, jitted, *args, **kwargs):
  """jitted.lower(*args).compile(), timed -> (compiled, Program)."""
  t0 = time.perf_counter()
  compiled = jitted.lower(*args, **kwargs).compile()
  return compiled, _program(name, compiled, time.perf_counter() - t0)


def _program(name, compiled, seconds) -> Program:
  stats = compiled.memory_analysis()
  return Program(name, int(stats.argument_size_in_bytes),
                 int(stats.output_size_in_bytes), int(stats.temp_size_in_bytes), int(stats.alias_size_in_bytes),
                 int(stats.generated_code_size_in_bytes), seconds)


def outputs(compiled):
  """A compiled program's outputs as ShapeDtypeStructs with the shardings XLA gave them."""
  return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding), compiled.out_info)


def abstract(shapes, shardings):
  """Pytrees of ShapeDtypeStruct and of shardings -> ShapeDtypeStructs that carry the shardings."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def sharded_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the most any device holds)."""
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def optimizer_state(pool, tx, params):
  """Abstract optimizer state of abstract `params`, where the Trainer puts it."""
  shardings = optimizer_shardings(pool, tx, jax.tree.map(lambda x: x.sharding, params), params)
  return abstract(jax.eval_shape(tx.init, params), shardings)


@dataclasses.dataclass(frozen=True)
class TrainState:
  """The abstract state a Trainer holds on its pool (params: the trained ones; frozen: a LoRA base)."""
  params: object
  opt_state: object
  critic_params: object = None
  critic_opt_state: object = None
  ref_params: object = None
  frozen: object = dataclasses.field(default_factory=dict)
  base_reference: bool = False  # LoRA with a KL: the reference is the base (the same arrays)

  def shardings(self):
    """The four states' shardings, as the Trainer pins its update's outputs."""
    sharding_of = lambda tree: None if tree is None else jax.tree.map(lambda x: x.sharding, tree)
    return tuple(map(sharding_of, (self.params, self.opt_state, self.critic_params, self.critic_opt_state)))


def train_state(policy, pool, tx, objective, reference=False) -> TrainState:
  """The Trainer's params, optimizer state, critic and reference, abstract, on `pool`. With LoRA the
  reference is the base (zero B), no array of its own."""
  params, frozen = policy.split(abstract(policy.shapes(), pool.shardings_for(policy.logical_axes(), policy.shapes())))
  critic_params = critic_opt_state = None
  if objective.critic_optimizer is not None:
    critic = critic_model(policy)
    critic_params = abstract(critic.shapes(), pool.shardings_for(critic.logical_axes(), critic.shapes()))
    critic_opt_state = optimizer_state(pool, objective.critic_optimizer, critic_params)
  return TrainState(params, optimizer_state(pool, tx, params), critic_params, critic_opt_state,
                    params if reference and not policy.lora else None, frozen, reference and policy.lora)


def full_batch(sequences: int, prompt_len: int, completion_len: int, group_size: int = 1) -> TrainBatch:
  """A host batch whose every sequence fills prompt_len + completion_len tokens: the largest
  layout a run of these sizes lays out."""
  width = prompt_len + completion_len
  return TrainBatch(tokens=np.ones((sequences, width), np.int32), valid=np.ones(
      (sequences, width), bool), loss_mask=np.ones((sequences, completion_len), bool), behav_logp=np.zeros(
          (sequences, completion_len), np.float32), rewards=np.zeros(sequences, np.float32),
                    group_ids=(np.arange(sequences) // group_size).astype(np.int32), versions=np.zeros(
                        (sequences, completion_len), np.int32))


def train_step(policy, pool, objective, tx, batch: TrainBatch, state: TrainState | None = None) -> dict:
  """Compiles the Trainer's start pass and minibatch update for `batch` on `pool` without data.
  -> {"start": Program, "update": Program, "layout": (M, K, R, L), "state": TrainState}."""
  state = state or train_state(policy, pool, tx, objective)
  layout = layout_of(objective, pool, batch)
  place = lambda x, s: jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype), sharding=s)
  rows, per_seq, slot, minibatch_of = step_inputs(pool, layout, batch, place)
  models = (policy, None if state.critic_params is None else critic_model(policy))
  whole = lora.merge(state.params, state.frozen)
  ref = whole if state.base_reference else state.ref_params
  inputs = StartInputs(whole, rows, per_seq, slot, minibatch_of, ref, state.critic_params)
  compiled_start, start = compile_program("start", start_program(pool, objective, models), inputs)
  data = outputs(compiled_start)[0]
  update_fn = update_program(pool, objective, models, tx, objective.critic_optimizer, state.shardings())
  i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=pool.replicated())
  _, update = compile_program("update", update_fn, state.params, state.opt_state, state.critic_params,
                              state.critic_opt_state, state.frozen, rows, data, i32, i32,
                              num_seqs=layout.slot.shape[0] + 1)
  return {"start": start, "update": update, "layout": layout.shape, "state": state}


def decode_step(policy, pool, max_new_tokens: int, **engine_options) -> Program:
  """Compiles the engine's decode program over its whole KV cache (the widest span it runs) for
  `pool` without weights; engine_options: the Engine keywords (slots, max_prompt_len, ...)."""
  engine = Engine(policy, pool, None, max_new_tokens, **dict({"eos_ids": (0,)}, **engine_options))
  jitted, args = engine.decode_program()
  return compile_program("decode", jitted, *args)[1]


def device_memory(pool, catalog=None) -> tuple[int, str]:
  """(bytes per device, where the figure comes from): the device's allocator limit where it
  reports one (GPU, TPU), else the catalog HBM of the pool's device_type; (0, "") when neither is
  known (simulated CPU devices of a hand-written mesh file)."""
  limit = int((local_device(pool).memory_stats() or {}).get("bytes_limit", 0))
  if limit:
    return limit, "device memory_stats bytes_limit"
  kind = pool.spec.device_type
  devices = catalog if catalog is not None else load_catalog()
  if kind in devices:
    return int(devices[kind].hbm_bytes), f"catalog hbm_gb of device_type {kind}"
  return 0, ""


def preflight(cfg, policy, pool, catalog=None) -> dict | None:
  """Compiles the RL train step of `cfg` at its largest layout on the train `pool` and raises a
  one-line UserError when it needs more memory per device than the device has. -> the figures,
  or None when the device memory is unknown (nothing compiled)."""
  capacity, source = device_memory(pool, catalog)
  if not capacity:
    return None
  r, a = cfg.rollout, cfg.algo
  objective = make_rl_loss(a, r.temperature)
  tx = make_optimizer(cfg.optim, cfg.train.steps * a.minibatches)
  batch = full_batch(r.prompts_per_step * r.group_size, bucket(r.max_prompt_len), r.max_new_tokens, r.group_size)
  step = train_step(policy, pool, objective, tx, batch, train_state(policy, pool, tx, objective, a.kl_coef > 0))
  # the reference stays on the pool through the update without being one of its arguments
  resident = sharded_bytes(step["state"].ref_params) if step["state"].ref_params is not None else 0
  need = max(step["start"].peak_bytes, step["update"].peak_bytes + resident)
  out = {"needed_bytes": need, "capacity_bytes": capacity, "source": source, "layout": step["layout"]}
  if need > capacity:
    _, k, rows, length = step["layout"]
    m = policy.cfg
    knobs = [f"lower algo.micro_batch_tokens (now {k} micro-batch(es) of {rows} rows x {length} tokens)"]
    knobs += ["set model.remat='full'"] if m.remat != "full" else []
    knobs += ["set model.scan_layers=True"] if not m.scan_layers else []
    if pool.axis_sizes.get("tensor", 1) > 1 and "tensor" not in pool.spec.rules["length"]:
      knobs += [f"split the sequence over tensor (pools.{pool.name}.rules: {{length: tensor}})"]
    knobs += [f"give pools.{pool.name}.mesh more fsdp (now {pool.axis_sizes})"]
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    raise UserError(f"pools.{pool.name}: the compiled train step needs {gib(need)} per device but a device has "
                    f"{gib(capacity)} ({source}); {', '.join(knobs)}")
  return out
