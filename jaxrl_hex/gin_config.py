"""gin as a second way to write the same run config.

Every section of the config (rollout, algo, optim, train, sft, task_args, model, sync, log, ...)
is a gin configurable of that name, and `config` is the top level, so

    rollout.temperature = 0.7        # same field as --config.rollout.temperature=0.7
    algo.clip_eps_high = 0.28        # losses and estimators live under algo
    config.task = 'arith'            # same as --config.task=arith
    task_args.digits = 3

`--gin_file` / `--gin_bindings` land on the ConfigDict that --config built, after its
--config.* overrides, so a gin run and the equivalent ml_collections run resolve to one config
and everything downstream (validation, config.json, checkpoints) is shared. Sections are read
from the config itself, so a field another module adds is bindable without a change here.
"""
import os

import gin
import ml_collections

from jaxrl_hex.config import resolve_path, unknown_key_message
from jaxrl_hex.errors import ConfigError

MODULE = "jaxrl_hex.config"
_CONFIGURABLES = {}  # dotted section path ("" = top level) -> gin configurable returning its bindings


def _configurable(path: str):
  """The gin configurable for one section, registered once per process."""
  if path not in _CONFIGURABLES:

    def section(**bindings):
      return bindings

    parent, _, name = path.rpartition(".")
    module = ".".join(filter(None, [MODULE, parent])) if path else "jaxrl_hex"
    section.__name__ = name or "config"
    _CONFIGURABLES[path] = gin.external_configurable(section, name=name or "config", module=module)
  return _CONFIGURABLES[path]


def _sections(cfg, prefix=""):
  yield prefix
  for key, value in cfg.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _sections(value, f"{prefix}.{key}" if prefix else key)


def apply_gin(cfg, files=(), bindings=()):
  """Binds gin files and bindings onto `cfg` in place, field by field; returns cfg."""
  sections = {path: _configurable(path) for path in _sections(cfg)}
  files = [_existing(f) for f in files]
  gin.clear_config()
  try:
    try:
      gin.parse_config_files_and_bindings(files, list(bindings))
    except (ValueError, SyntaxError) as e:
      known = sorted(p.rpartition(".")[2] or "config" for p in sections)
      raise ConfigError(f"gin: {' '.join(str(e).split())}; configurables: {', '.join(known)}") from None
    for path, section in sections.items():
      for key, value in section().items():
        _assign(cfg, f"{path}.{key}" if path else key, value)
  finally:
    gin.clear_config()
  return cfg


def _existing(path: str) -> str:
  resolved = resolve_path(path)
  if not os.path.isfile(resolved):
    raise ConfigError(f"--gin_file: {path!r} does not exist; pass a .gin file such as configs/arith_grpo.gin")
  return resolved


def _assign(cfg, key: str, value):
  *parents, leaf = key.split(".")
  node = cfg
  for part in parents:
    node = node[part]
  if leaf not in node:
    raise ConfigError(f"gin: {unknown_key_message(cfg, key)}")
  if isinstance(node[leaf], ml_collections.ConfigDict) and isinstance(value, dict):
    for k, v in value.items():  # config.rollout = {'temperature': 0.7} binds field by field
      _assign(cfg, f"{key}.{k}", v)
    return
  try:
    node[leaf] = value
  except TypeError:
    raise ConfigError(f"gin: {key} = {value!r} has type {type(value).__name__} but the field is "
                      f"{type(node[leaf]).__name__} (default {node[leaf]!r})") from None
