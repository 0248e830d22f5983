"""Presets through the whole async loop: DAPO's dynamic sampling on the rollout side, PPO's
critic checkpointed and resumed with the run."""
import os

from support import SMALL, load_config

from jaxrl_hex import commands
from jaxrl_hex.checkpoint import Checkpointer
from jaxrl_hex.metrics import read_jsonl


def _rows(workdir):
  return [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") == "train"][1:]


def test_dapo_fills_batches_with_informative_groups(tmp_path, warm_workdir):
  cfg = load_config("configs/dapo.py", **SMALL, **{"init_from": warm_workdir, "train.steps": 3})
  commands.train(cfg, str(tmp_path / "dapo"))
  rows = _rows(str(tmp_path / "dapo"))
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r in rows:
    assert r["dynamic_sampling_rounds"] >= 1 and 0 < r["informative_group_fraction"] <= 1
    # every group kept varies, unless the round cap forced uninformative ones in
    assert r["advantage_abs_mean"] > 0


def test_ppo_critic_is_checkpointed_and_resumed(tmp_path, warm_workdir):
  workdir = str(tmp_path / "ppo")
  overrides = {**SMALL, "init_from": warm_workdir, "train.checkpoint_every": 2}
  commands.train(load_config("configs/ppo.py", **overrides, **{"train.steps": 2}), workdir)
  saved = Checkpointer(os.path.join(workdir, "checkpoints"))._mngr.item_metadata(2)
  assert saved.get("critic") is not None
  commands.train(load_config("configs/ppo.py", **overrides, **{"train.steps": 3}), workdir, resume=True)
  rows = _rows(workdir)
  assert rows[-1]["step"] == 3 and rows[-1]["value_loss"] >= 0
