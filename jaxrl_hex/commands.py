"""The train and sft commands: build the runtime and the pools' sides, run, summarise."""
import json
import os
import time

from jaxrl_hex.checkpoint import Checkpointer, CheckpointError
from jaxrl_hex.cluster import build_sides
from jaxrl_hex.config import resolve_path
from jaxrl_hex.metrics import Recorder
from jaxrl_hex.models.hf import load_params
from jaxrl_hex.orchestrator import Orchestrator
from jaxrl_hex.runtime import build_runtime
from jaxrl_hex.sft import run_sft


def _prepare_workdir(cfg, workdir, resume):
  ckpt_dir = os.path.join(workdir, "checkpoints")
  has_ckpt = os.path.isdir(ckpt_dir) and Checkpointer(ckpt_dir).latest_step() is not None
  if resume and not has_ckpt:
    raise CheckpointError(f"--resume: {workdir} has no checkpoint to resume from; drop --resume to start a new run")
  if not resume and has_ckpt:
    raise CheckpointError(f"{workdir} already holds a run; pass --resume to continue it or pick another --workdir")
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(cfg.to_json_best_effort(indent=2))
  return ckpt_dir


def write_cluster(workdir, train, rollout):
  """cluster.json: every pool, its role, hosts, process ids, devices and mesh (rewritten on restarts)."""
  path = os.path.join(workdir, "cluster.json")
  with open(path + ".tmp", "w") as f:
    json.dump({"train": train.describe(), "rollout": rollout.describe()}, f, indent=2)
  os.replace(path + ".tmp", path)


def sft(cfg, workdir, resume=False):
  rt = build_runtime(cfg)
  ckpt_dir = _prepare_workdir(cfg, workdir, resume=False)
  recorder = Recorder(workdir, config=cfg)
  params = (load_params(resolve_path(cfg.model_dir), rt.policy.cfg, rt.shardings("train"))
            if cfg.get("model_dir") else rt.policy.init(cfg.seed, rt.shardings("train")))
  checkpointer = Checkpointer(ckpt_dir, cfg.train.keep_checkpoints)
  _, summary = run_sft(rt, params, recorder, checkpointer)
  checkpointer.close()
  recorder.close()
  return summary


def train(cfg, workdir, resume=False):
  t0 = time.time()
  rt = build_runtime(cfg)
  _prepare_workdir(cfg, workdir, resume)
  recorder = Recorder(workdir, append=resume, config=cfg)
  train_side, rollout_side = build_sides(rt, workdir, resume, recorder)
  try:
    write_cluster(workdir, train_side, rollout_side)
    rollout_side.on_restart = lambda: write_cluster(workdir, train_side, rollout_side)
    summary = Orchestrator(rt, train_side, rollout_side, recorder).run()
  finally:
    train_side.close()
    rollout_side.close()
    recorder.close()
  summary["warmstart"] = train_side.warmstart
  summary["wall_seconds"] = time.time() - t0
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary
