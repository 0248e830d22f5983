"""gin binds the same config fields as --config.*: a gin run and the equivalent ml_collections run
resolve to one config, through the one CLI function."""
import json
import os

import pytest
from support import ROOT, SMALL, load_config

from jaxrl_hex import cli
from jaxrl_hex.errors import ConfigError
from jaxrl_hex.gin_config import apply_gin

# one binding per configurable part: task, engine, loss, optimiser, loop, sync, sinks (model: below)
GIN = """
config.seed = 3
config.task = 'arith'
task_args.digits = 2
rollout.temperature = 0.9
rollout.top_k = 8
algo.clip_eps_high = 0.3
algo.behav_weight_mode = 'truncate'
algo.advantage = 'rloo'
algo.critic.vf_coef = 0.25
optim.lr = 1e-4
train.max_staleness = 1
sync.method = 'orbax'
log.tensorboard = False
"""
SAME = {
    "seed": 3,
    "task": "arith",
    "task_args.digits": 2,
    "rollout.temperature": 0.9,
    "rollout.top_k": 8,
    "algo.clip_eps_high": 0.3,
    "algo.behav_weight_mode": "truncate",
    "algo.advantage": "rloo",
    "algo.critic.vf_coef": 0.25,
    "optim.lr": 1e-4,
    "train.max_staleness": 1,
    "sync.method": "orbax",
    "log.tensorboard": False
}


def test_gin_file_and_config_overrides_resolve_alike(tmp_path):
  path = tmp_path / "run.gin"
  path.write_text(GIN)
  by_gin = apply_gin(load_config(), [str(path)])
  by_flags = load_config(**SAME)
  assert by_gin.to_dict() == by_flags.to_dict()
  assert by_gin.rollout.temperature == 0.9 and by_gin != load_config()


def test_bindings_forms_and_precedence():
  cfg = apply_gin(
      load_config(**{"train.steps": 7}),
      bindings=[
          "config.rollout.top_p = 0.95",  # module-qualified section
          "config.sft = {'batch_size': 32}",  # a whole section, field by field
          "rollout.temperature = 1",  # an int where the field is a float
          "train.steps = 9"
      ])  # gin lands after --config.* overrides
  assert cfg.rollout.top_p == 0.95 and cfg.sft.batch_size == 32 and cfg.sft.lr == load_config().sft.lr
  assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
  assert cfg.train.steps == 9


def test_the_example_gin_file_binds_known_fields():
  cfg = apply_gin(load_config(), [os.path.join(ROOT, "configs", "arith_grpo.gin")])
  assert (cfg.seed, cfg.rollout.temperature, cfg.algo.behav_weight_mode, cfg.train.max_staleness) == (1, 0.9,
                                                                                                      "truncate", 4)


@pytest.mark.parametrize("binding, message", [
    ("rollout.temprature = 0.5", "unknown config key 'rollout.temprature'; known keys under rollout:"),
    ("rollot.temperature = 0.5", "No configurable matching 'rollot'"),
    ("train.steps = 'many'", "train.steps = 'many' has type str but the field is int"),
    ("config.sedd = 1", "unknown config key 'sedd'; known keys:"),
])
def test_bad_bindings_name_the_field(binding, message):
  with pytest.raises(ConfigError, match="^gin: ") as e:
    apply_gin(load_config(), bindings=[binding])
  assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_gin_file(capsys, tmp_path):
  assert cli.main(["train", f"--workdir={tmp_path}", "--gin_file=nowhere.gin"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == ("jaxrl-hex: error: --gin_file: 'nowhere.gin' does not exist; pass a .gin file such as "
                 "configs/arith_grpo.gin")


def test_gin_run_and_ml_collections_run_write_the_same_config(tmp_path, warm_workdir):
  """Both through `jaxrl-hex train` (zero RL steps from a warm checkpoint: resolve, build, write)."""
  path = tmp_path / "run.gin"
  path.write_text(GIN)
  common = [
      f"--config.init_from={warm_workdir}", "--config.train.steps=0", *[f"--config.{k}={v}" for k, v in SMALL.items()]
  ]
  assert cli.main(
      ["train", f"--workdir={tmp_path / 'gin'}", *common, f"--gin_file={path}",
       "--gin_bindings=model.vocab_size = 0"]) == 0
  flags = [f"--config.{k}={v}" for k, v in SAME.items()]
  assert cli.main(["train", f"--workdir={tmp_path / 'flags'}", *common, *flags, "--config.model.vocab_size=0"]) == 0
  by_gin = json.load(open(tmp_path / "gin" / "config.json"))
  by_flags = json.load(open(tmp_path / "flags" / "config.json"))
  assert by_gin == by_flags
  # resolved, not just parsed: vocab_size=0 became the task tokenizer's size, rounded to shard
  assert by_gin["model"]["vocab_size"] == 16 and by_gin["sync"]["method"] == "orbax"
