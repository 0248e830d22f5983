import argparse
import os
import re

import jax
import numpy as np
import optax
import pytest

from jaxrl_hex.checkpoint import Checkpointer, CheckpointError, read_best, split_run, step_arg
from jaxrl_hex.models.config import model_config
from jaxrl_hex.models.policy import Policy

CFG = model_config(vocab_size=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)


def _state(pools, cfg=CFG, seed=0):
  policy = Policy.build(cfg)
  params = policy.init(seed, pools["train"].shardings_for(policy.logical_axes(), policy.shapes()))
  return {"params": params, "opt_state": jax.jit(optax.adamw(1e-3).init)(params)}


def test_round_trip_onto_the_live_shardings(pools, tmp_path):
  state = _state(pools)
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(5, state, {"policy_version": 5, "data_state": {"next_index": 7}})
  ckpt.wait()
  restored, meta = ckpt.restore(_state(pools, seed=1))
  assert meta == {"policy_version": 5, "data_state": {"next_index": 7}}
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
    assert a.sharding == b.sharding


def test_half_written_step_is_ignored_and_the_previous_one_restored(pools, tmp_path):
  state = _state(pools)
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(3, state, {"policy_version": 3})
  ckpt.wait()
  ckpt.close()
  # what a kill during the save of step 6 leaves: orbax's temporary directory, never renamed
  partial = tmp_path / "6.orbax-checkpoint-tmp-1234567"
  (partial / "params").mkdir(parents=True)
  (partial / "params" / "garbage").write_bytes(b"\0" * 100)
  reopened = Checkpointer(str(tmp_path))
  assert reopened.latest_step() == 3
  _, meta = reopened.restore(_state(pools, seed=2))
  assert meta["policy_version"] == 3


def test_checkpoint_of_another_shape_is_refused_by_name(pools, tmp_path):
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, _state(pools), {})
  ckpt.wait()
  other = model_config(vocab_size=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=128)
  with pytest.raises(CheckpointError, match=r"params/layers/0/mlp/\w+ has shape \(\d+, \d+\) but this config builds"):
    ckpt.restore(_state(pools, cfg=other))


def test_keeps_the_last_k(pools, tmp_path):
  state = _state(pools)
  ckpt = Checkpointer(str(tmp_path), keep=2)
  for step in (1, 2, 3):
    ckpt.save(step, state, {})
  ckpt.wait()
  assert sorted(int(p) for p in os.listdir(tmp_path) if p.isdigit()) == [2, 3]


# orbax's failed read of a truncated shard leaves a callback for its closed event loop
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncated shard", "garbage metadata"])
def test_a_damaged_step_is_named_in_one_line_and_the_newest_intact_one_restored(pools, tmp_path, capsys, damage):
  state = _state(pools)
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(3, state, {"policy_version": 3})
  ckpt.save(6, state, {"policy_version": 6})
  ckpt.close()
  if damage == "truncated shard":
    for f in (tmp_path / "6" / "params").rglob("d/*"):
      f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
  else:
    (tmp_path / "6" / "params" / "_METADATA").write_text("garbage{")
  reopened = Checkpointer(str(tmp_path))
  restored, meta = reopened.restore(_state(pools, seed=1))
  assert meta["policy_version"] == 3
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 2 and err[0].startswith("jaxrl-hex: checkpoint 6 is damaged: ")
  assert err[1] == "jaxrl-hex: resuming from checkpoint 3, the newest intact one"
  with pytest.raises(CheckpointError, match=r"^checkpoint 6 is damaged: ") as e:
    reopened.restore(_state(pools, seed=1), step=6)  # a step asked for by name: no fallback
  assert "\n" not in str(e.value)
  assert reopened.supersede(3) == [6] and reopened.steps() == [3]
  assert [p.name.split("-")[0] for p in (tmp_path / "superseded").iterdir()] == ["6"]
  reopened.save(6, state, {"policy_version": 6})  # the run's next save of that step does not collide
  assert reopened.steps() == [3, 6]
  reopened.close()


def test_every_kept_step_damaged_is_one_line(pools, tmp_path):
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(2, _state(pools), {})
  ckpt.close()
  (tmp_path / "2" / "meta" / "metadata").write_text("{")
  reopened = Checkpointer(str(tmp_path))
  with pytest.raises(CheckpointError, match=r"every kept checkpoint in .* is damaged \(steps \[2\]\)"):
    reopened.restore(_state(pools))
  reopened.close()


def _best(step, value):
  return {"step": step, "metric": "eval_accuracy", "mode": "max", "value": value}


def test_the_best_is_kept_beside_the_last_k_and_named_once_its_save_is_complete(pools, tmp_path):
  state, like = _state(pools), _state(pools, seed=1)
  ckpt = Checkpointer(str(tmp_path), keep=2)
  for step in (1, 2, 3, 4):
    ckpt.save(step, state, {"policy_version": step, "best": _best(1, 0.5)})
  ckpt.wait()
  assert ckpt.steps() == [1, 3, 4] and read_best(str(tmp_path)) == _best(1, 0.5)
  ckpt.save(5, state, {"policy_version": 5, "best": _best(5, 0.75)})
  assert read_best(str(tmp_path)) == _best(1, 0.5)  # step 5 may still be in flight
  ckpt.wait()
  assert ckpt.steps() == [4, 5] and read_best(str(tmp_path)) == _best(5, 0.75)
  assert ckpt.restore(like, step="best")[1]["policy_version"] == 5
  assert "best" not in ckpt.restore(like, step=4)[1]  # its best, step 1, is gone
  ckpt.close()
  reopened = Checkpointer(str(tmp_path), keep=2)  # a resumed run: best.json goes on protecting step 5
  for step in (6, 7, 8):
    reopened.save(step, state, {"policy_version": step, "best": _best(5, 0.75)})
  reopened.close()
  assert reopened.steps() == [5, 7, 8] and reopened.resolve("best") == 5


def test_a_resume_before_the_best_names_the_best_as_of_its_step(pools, tmp_path):
  state = _state(pools)
  ckpt = Checkpointer(str(tmp_path), keep=3)
  for step, best in ((1, 1), (2, 2), (3, 2), (4, 4)):
    ckpt.save(step, state, {"best": _best(best, best / 10)})
  ckpt.wait()
  assert ckpt.steps() == [2, 3, 4] and ckpt.best == _best(4, 0.4)
  assert ckpt.supersede(3) == [4]
  assert ckpt.best == read_best(str(tmp_path)) == _best(2, 0.2)
  ckpt.close()
  other = Checkpointer(str(tmp_path / "b"), keep=2)
  for step, best in ((1, 1), (2, 1), (3, 1), (4, 4)):
    other.save(step, state, {"best": _best(best, best / 10)})
  other.wait()
  assert other.steps() == [3, 4]
  assert other.supersede(3) == [4]  # step 3's best, step 1, went when step 4 became the best: none is named
  assert other.best is None and read_best(str(tmp_path / "b")) is None
  with pytest.raises(CheckpointError, match=r"^--step=best: .* holds no best checkpoint \(no best.json\)"):
    other.resolve("best")
  other.close()


def test_step_values_and_init_from_references():
  assert [step_arg(s) for s in ("7", "0", "best", "latest")] == [7, 0, "best", None]
  for bad in ("-1", "last", "3.5"):
    with pytest.raises(argparse.ArgumentTypeError, match=f"^'{re.escape(bad)}' is not a checkpoint"):
      step_arg(bad)
  assert split_run("runs/a") == ("runs/a", None)
  assert split_run("runs/a:best") == ("runs/a", "best")
  assert split_run("/x/runs/a:12") == ("/x/runs/a", 12)
  assert split_run("runs/a:b") == ("runs/a:b", None)
