"""The train and sft commands: build the runtime, restore or warm-start, run, summarise."""
import json
import os
import time

import jax

from jaxrl_hex.checkpoint import Checkpointer, CheckpointError
from jaxrl_hex.config import resolve_path
from jaxrl_hex.metrics import Recorder
from jaxrl_hex.orchestrator import Orchestrator
from jaxrl_hex.rl.objectives import make_rl_loss
from jaxrl_hex.rl.trainer import Trainer, make_optimizer
from jaxrl_hex.runtime import build_runtime
from jaxrl_hex.sft import run_sft
from jaxrl_hex.sync import make_sync


def _prepare_workdir(workdir, resume):
  ckpt_dir = os.path.join(workdir, "checkpoints")
  has_ckpt = os.path.isdir(ckpt_dir) and Checkpointer(ckpt_dir).latest_step() is not None
  if resume and not has_ckpt:
    raise CheckpointError(f"--resume: {workdir} has no checkpoint to resume from; drop --resume to start a new run")
  if not resume and has_ckpt:
    raise CheckpointError(f"{workdir} already holds a run; pass --resume to continue it or pick another --workdir")
  return ckpt_dir


def _write_config(cfg, workdir):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(cfg.to_json_best_effort(indent=2))


def _train_params(rt, like):
  """Fresh params on the train pool (the shape every restore and warm start lands on)."""
  shardings = rt.pools["train"].shardings_for(rt.policy.logical_axes(), rt.policy.shapes())
  return rt.policy.init(rt.cfg.seed, shardings) if like is None else like


def sft(cfg, workdir, resume=False):
  rt = build_runtime(cfg)
  ckpt_dir = _prepare_workdir(workdir, resume=False)
  _write_config(cfg, workdir)
  recorder = Recorder(workdir)
  params = _train_params(rt, None)
  checkpointer = Checkpointer(ckpt_dir, cfg.train.keep_checkpoints)
  _, summary = run_sft(rt, params, recorder, checkpointer)
  checkpointer.close()
  recorder.close()
  return summary


def train(cfg, workdir, resume=False):
  t0 = time.time()
  rt = build_runtime(cfg)
  ckpt_dir = _prepare_workdir(workdir, resume)
  _write_config(cfg, workdir)
  with open(os.path.join(workdir, "cluster.json"), "w") as f:
    json.dump({name: pool.describe() for name, pool in rt.pools.items()}, f, indent=2)
  recorder = Recorder(workdir, append=resume)
  checkpointer = Checkpointer(ckpt_dir, cfg.train.keep_checkpoints)
  params = _train_params(rt, None)
  warm = None
  if cfg.init_from and not resume:  # on resume, params come from the run's own checkpoint below
    init_dir = os.path.join(resolve_path(cfg.init_from), "checkpoints")
    if not os.path.isdir(init_dir):
      raise CheckpointError(f"init_from: {cfg.init_from!r} has no checkpoints/ directory; point it at the workdir of an sft or train run")
    params = Checkpointer(init_dir).restore({"params": params}, with_meta=False)[0]["params"]
  elif not resume:
    params, warm = run_sft(rt, params, recorder, phase="warmstart")
  ref = params if cfg.algo.kl_coef > 0 else None
  trainer = Trainer(rt.policy, rt.pools["train"], make_optimizer(cfg.optim, cfg.train.steps),
                    make_rl_loss(cfg.algo, cfg.rollout.temperature), params,
                    ref_params=None if ref is None else jax.tree.map(lambda x: x.copy(), ref))
  next_batch, data_state = 0, None
  if resume:
    state = {"params": trainer.params, "opt_state": trainer.opt_state}
    if trainer.ref_params is not None:
      state["ref_params"] = trainer.ref_params
    restored, meta = checkpointer.restore(state)
    trainer.load_state(restored, meta["policy_version"])
    trainer.ref_params = restored.get("ref_params")
    next_batch, data_state = meta["next_batch"], meta["data_state"]
  rollout_pool = rt.pools["rollout"]
  sync = make_sync(cfg.sync.method,
                   rollout_pool.shardings_for(rt.policy.logical_axes(), rt.policy.shapes()),
                   rt.policy.shapes(), cfg.sync.directory or os.path.join(workdir, "sync"))
  orchestrator = Orchestrator(rt, trainer, sync, recorder, checkpointer, next_batch, data_state)
  summary = orchestrator.run()
  checkpointer.close()
  recorder.close()
  summary["warmstart"] = warm
  summary["wall_seconds"] = time.time() - t0
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary
