"""The run config: command-line overrides parsed as each field's type, one-line errors, and the
config.json a run saves read back with the defaults of fields added since."""
import json

import pytest

from jaxrl_hex.config import (
    apply_overrides,
    base_config,
    load_config_file,
    read_run_config,
    validate_fields,
    write_run_config,
)
from jaxrl_hex.errors import ConfigError


def test_overrides_take_the_type_of_their_field():
  cfg = base_config()
  apply_overrides(cfg, [("train.steps", "7"), ("optim.lr", "1e-3"), ("algo.pack", "true"), ("rollout.stop", "['\\n']"),
                        ("task", "path/to/task.py:make_task"),
                        ("model.rope_scaling", "{'rope_type': 'linear', 'factor': 2.0}")])
  assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
  assert cfg.optim.lr == 1e-3 and cfg.algo.pack is True and list(cfg.rollout.stop) == ["\n"]
  assert cfg.task == "path/to/task.py:make_task" and cfg.model.rope_scaling.factor == 2.0
  apply_overrides(cfg, [("optim.lr", "3"), ("algo.pack", "0")])  # an int where a float goes is a float
  assert cfg.optim.lr == 3.0 and isinstance(cfg.optim.lr, float) and cfg.algo.pack is False


@pytest.mark.parametrize("key, value, message", [
    ("train.stepz", "3", "unknown config key 'train.stepz'; known keys under train: checkpoint_every"),
    ("trian.steps", "3", "unknown config key 'trian.steps': 'trian' is not a section"),
    ("train.steps", "abc", "--config.train.steps='abc' is not a int (the field's default is 400)"),
    ("algo.pack", "maybe", "--config.algo.pack='maybe' is not a bool (the field's default is False)"),
    ("train", "3", "--config.train is a section, not a field; set its fields, e.g. --config.train.checkpoint_every="),
])
def test_bad_overrides_name_the_field(key, value, message):
  with pytest.raises(ConfigError) as e:
    apply_overrides(base_config(), [(key, value)])
  assert str(e.value).startswith(message), str(e.value)


def test_field_checks():
  cfg = base_config()
  cfg.train.max_staleness = -1
  with pytest.raises(ConfigError, match="train.max_staleness must be >= 0"):
    validate_fields(cfg)


def test_a_saved_config_reads_back_with_the_defaults_of_newer_fields(tmp_path):
  cfg = base_config()
  cfg.train.steps, cfg.model.layer_types = 11, ("full",) * cfg.model.n_layers
  write_run_config(cfg, str(tmp_path))
  saved = json.loads((tmp_path / "config.json").read_text())
  del saved["rollout"]["steps_per_sync"]  # a run saved before the field existed
  (tmp_path / "config.json").write_text(json.dumps(saved))
  back = read_run_config(str(tmp_path))
  assert back.train.steps == 11 and back.rollout.steps_per_sync == base_config().rollout.steps_per_sync
  assert tuple(back.model.layer_types) == ("full",) * cfg.model.n_layers
  with pytest.raises(ConfigError, match="--to-hf: .*config.json does not exist; point --to-hf at a train or sft run"):
    read_run_config(str(tmp_path / "nowhere"), "--to-hf")


def test_config_files_that_cannot_load(tmp_path):
  with pytest.raises(ConfigError, match="has no get_config"):
    (tmp_path / "c.py").write_text("x = 1\n")
    load_config_file(str(tmp_path / "c.py"))
  with pytest.raises(Exception, match="does not exist"):
    load_config_file(str(tmp_path / "missing.py"))


def test_scan_layers_takes_auto_or_a_bool_from_the_command_line_and_config_files():
  cfg = base_config()
  assert cfg.model.scan_layers == "auto" and cfg.model.dtype == "float32"
  apply_overrides(cfg, [("model.scan_layers", "true"), ("model.dtype", "auto")])
  assert cfg.model.scan_layers is True and cfg.model.dtype == "auto"
  apply_overrides(cfg, [("model.scan_layers", "auto")])
  assert cfg.model.scan_layers == "auto"
  cfg.model.scan_layers = False  # a config file sets a bool over "auto"
  assert cfg.model.scan_layers is False
  with pytest.raises(ConfigError) as e:
    apply_overrides(cfg, [("model.scan_layers", "maybe")])
  assert str(e.value) == "--config.model.scan_layers='maybe' is not a bool or 'auto' (the field's default is False)"
