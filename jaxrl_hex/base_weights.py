"""Where a run's first weights come from, and with LoRA where its frozen base lives.

A run starts from init_from (a run's checkpoint), model_dir (a Hugging Face directory) or a
supervised warm start. With LoRA (model.lora.rank > 0) these give the frozen base, fresh adapters
go on top, and the run's checkpoints hold only the adapters and their optimizer state. The base
is not copied into them: checkpoints/lora_base.json records where it is (a checkpoint and step,
an HF directory, or WORKDIR/base, where a warm start's weights are saved once) with its
fingerprint (sync/fingerprint.py), so a resume, `eval`, `generate` and `convert` load the same
base again and refuse one that is not it.
"""
import json
import os

import jax

from jaxrl_hex.checkpoint import Checkpointer, CheckpointError, split_run
from jaxrl_hex.config import read_run_config, resolve_path
from jaxrl_hex.errors import ConfigError
from jaxrl_hex.models import lora
from jaxrl_hex.models.hf import load_params
from jaxrl_hex.models.model_dir import resolve_model_dir
from jaxrl_hex.sft import run_sft
from jaxrl_hex.sync.fingerprint import fingerprint, first_difference

BASE_RECORD = "lora_base.json"  # in checkpoints/: {checkpoint, step} or {model_dir}, and the base's fingerprint


def first_weights(rt, workdir, resume, recorder, warm_start=True):
  """The whole params a run starts from, on the train pool -> (params, warm start summary or None).
  On a resume these are placeholders the checkpoint overwrites, except the LoRA base, which is read
  again from where the run's record says. Without init_from or model_dir: a supervised warm start
  (warm_start, the train command) or fresh weights (the sft command, which is the warm start)."""
  cfg, policy = rt.cfg, rt.policy
  base = policy.base()
  pool = rt.pool("train")
  shardings = pool.shardings_for(base.logical_axes(), base.shapes())
  record_path = os.path.join(workdir, "checkpoints", BASE_RECORD)
  warmstart, record = None, None
  if resume and policy.lora:
    params = load_base(base, read_record(record_path), shardings, "--resume")
  elif resume:
    params = base.init(cfg.seed, shardings)
  elif cfg.init_from:
    params, record = _from_run(rt, cfg.init_from, shardings)
  elif cfg.get("model_dir"):
    params, record = load_params(resolve_model_dir(cfg.model_dir), base.cfg, shardings), {"model_dir": cfg.model_dir}
  elif not warm_start:
    check_base_source(cfg)
    params = base.init(cfg.seed, shardings)
  else:
    params, warmstart = run_sft(rt, base.init(cfg.seed, shardings), recorder, phase="warmstart", policy=base)
    if policy.lora:  # the base of every checkpoint this run writes: saved once, beside them
      saver = Checkpointer(os.path.join(workdir, "base"), keep=1)
      saver.save(0, {"params": params}, {"phase": "warmstart"})
      saver.close()
      record = {"checkpoint": os.path.join(os.path.abspath(workdir), "base"), "step": 0}
  if policy.lora and not lora.split(params)[0]:  # fresh adapters, unless init_from gave a LoRA run's own
    if record is not None:
      write_record(record_path, dict(record, fingerprint=fingerprint(params)))
    adapters = policy.init_adapters(cfg.seed,
                                    policy.split(pool.shardings_for(policy.logical_axes(), policy.shapes()))[0])
    params = lora.merge(adapters, params)
  elif policy.lora and record is not None:
    write_record(record_path, record)
  return params, warmstart


def check_base_source(cfg):
  """A LoRA run without a warm start (the sft command) needs a base to put its adapters on."""
  if cfg.model.lora.rank > 0 and not (cfg.init_from or cfg.get("model_dir")):
    raise ConfigError("model.lora.rank > 0 trains adapters on a frozen base, and this run has none: set "
                      "--config.model_dir (a Hugging Face model) or --config.init_from (a run's workdir)")


def _from_run(rt, ref: str, shardings):
  """init_from=WORKDIR[:best|:N] -> (its params, the record naming the base). A whole-weights run's
  params are this run's base; a LoRA run's adapters go on in this run, on its base (shardings: the
  base's on the train pool)."""
  policy, field = rt.policy, f"init_from={ref}"
  run, step = split_run(ref)
  directory = os.path.join(resolve_path(run), "checkpoints")
  if not os.path.isdir(directory):
    raise CheckpointError(f"init_from: {ref!r} has no checkpoints/ directory; point it at the workdir of an sft or "
                          "train run")
  checkpointer = Checkpointer(directory)
  step = checkpointer.resolve(step, field)
  record_path = os.path.join(directory, BASE_RECORD)
  if not os.path.isfile(record_path):
    params = checkpointer.restore({"params": _like(policy.base(), shardings)}, step, with_meta=False,
                                  field=field)[0]["params"]
    return params, {"checkpoint": os.path.abspath(directory), "step": step}
  source = read_run_config(resolve_path(run), "init_from").model.lora
  if not policy.lora:
    raise CheckpointError(f"{field}: that run trained LoRA adapters (rank {source.rank}) and this run has none; set "
                          f"--config.model.lora.rank={source.rank} to go on training them, or export the run merged "
                          "with `jaxrl-hex convert --to-hf` and set --config.model_dir to the export")
  for key in ("rank", "alpha", "targets"):
    if _plain(source[key]) != _plain(policy.cfg.lora[key]):
      raise CheckpointError(f"{field}: its adapters have model.lora.{key}={_plain(source[key])!r}, this run "
                            f"{_plain(policy.cfg.lora[key])!r}; set --config.model.lora.{key} to theirs to go on "
                            "training them")
  record = read_record(record_path)
  base = load_base(policy.base(), record, shardings, field)
  adapters_like = policy.split(_like(policy, rt.pool("train").shardings_for(policy.logical_axes(), policy.shapes())))[0]
  adapters = checkpointer.restore({"params": adapters_like}, step, with_meta=False, field=field)[0]["params"]
  return lora.merge(adapters, base), record


def _plain(value):
  return tuple(value) if isinstance(value, (list, tuple)) else value


def _like(policy, shardings):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), policy.shapes(), shardings)


def read_record(path: str) -> dict:
  if not os.path.isfile(path):
    raise CheckpointError(f"{path} is missing: this LoRA run's checkpoints hold adapters only, and that file names "
                          "their base; restore it from a copy of the run, or start a new run")
  with open(path) as f:
    return json.load(f)


def write_record(path: str, record: dict):
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(record, f)
    os.replace(path + ".tmp", path)


def load_base(base, record: dict, shardings, field: str):
  """The base a LoRA run's record names, in `shardings`; refuses one whose fingerprint differs."""
  if "model_dir" in record:
    params = load_params(resolve_model_dir(record["model_dir"]), base.cfg, shardings)
    where = f"model_dir={record['model_dir']}"
  else:
    params = Checkpointer(record["checkpoint"]).restore({"params": _like(base, shardings)}, record["step"],
                                                        with_meta=False, field=field)[0]["params"]
    where = f"checkpoint {record['step']} of {record['checkpoint']}"
  difference = first_difference(record["fingerprint"], fingerprint(params))
  if difference:
    leaf = difference.split(" differs")[0].split(" is missing")[0]
    raise CheckpointError(f"{field}: the LoRA base ({where}) is not the one this run's adapters were trained on "
                          f"({leaf} differs from its fingerprint in {BASE_RECORD}); put the original base back there "
                          "or start a new run from this base")
  return params


def restore_run(policy, directory: str, step, shardings, field: str = "--step"):
  """A run's checkpoint as the whole model's params in `shardings` (a pytree like policy.shapes())
  -> (params, meta): the saved params, or with LoRA the saved adapters on the base its record names."""
  adapters_like, base_shardings = policy.split(_like(policy, shardings))
  params, meta = Checkpointer(directory).restore({"params": adapters_like}, step, field=field)
  if not policy.lora:
    return params["params"], meta
  base = policy.base()
  record = read_record(os.path.join(directory, BASE_RECORD))
  return lora.merge(params["params"], load_base(base, record, jax.tree.map(lambda x: x.sharding, base_shardings),
                                                field)), meta
