"""Orbax checkpoints of a run: model, optimizer, policy version, data position and RNG.

Orbax writes each step to a temporary directory and renames it when complete, so a run
killed mid-save leaves only a step that latest_step() ignores: resume takes the previous one. A
step damaged after it was written (a truncated shard, garbage metadata) fails to restore; resume
then says so in one line and takes the newest kept step that restores, and the steps after it
move to checkpoints/superseded/, so the run's new saves do not collide with them.
"""
import os
import shutil
import sys

import jax
import orbax.checkpoint as ocp

from jaxrl_hex.errors import UserError

STATE_ITEMS = ("params", "opt_state", "ref_params", "critic")  # critic: {params, opt_state} (PPO)


class CheckpointError(UserError):
  pass


class DamagedCheckpoint(CheckpointError):
  """A step that is there but does not restore: files truncated or overwritten after the save."""

  def __init__(self, step, what, cause):
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:160]
    super().__init__(f"checkpoint {step} is damaged: {what} ({type(cause).__name__}: {first})")
    self.step = step


def _path(path) -> str:
  """A key path as 'a/0/b', the same whether a level is a dict, list or namedtuple."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:

  def __init__(self, directory: str, keep: int = 2):
    self.directory = os.path.abspath(directory)
    # handlers named up front, so a fresh process can read a checkpoint's metadata before restoring
    handlers = {name: ocp.StandardCheckpointHandler() for name in STATE_ITEMS}
    handlers["meta"] = ocp.JsonCheckpointHandler()
    self._mngr = ocp.CheckpointManager(self.directory, item_handlers=handlers,
                                       options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self):
    return self._mngr.latest_step()

  def save(self, step: int, state: dict, meta: dict):
    """state: {name in STATE_ITEMS: pytree of jax arrays}; meta: JSON (version, data position, rng)."""
    items = {name: ocp.args.StandardSave(tree) for name, tree in state.items()}
    self._mngr.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items))

  def wait(self):
    self._mngr.wait_until_finished()

  def steps(self) -> list:
    return sorted(self._mngr.all_steps())

  def restore(self, like_state: dict, step=None, with_meta=True):
    """Restores the items named in `like_state` onto its shardings (the live layout of this run)
    -> (state, meta). `step` None: the newest step that restores, after a line on stderr for
    each damaged newer one; a given step must restore."""
    steps = self.steps()
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory}: the run saved none yet; start it again without "
                            "--resume, or point --workdir at a run that saved one")
    if step is not None:
      if step not in steps:
        raise CheckpointError(f"--step={step}: no checkpoint {step} in {self.directory}; kept steps: {steps}")
      return self._restore_step(like_state, step, with_meta)
    damaged = []
    for candidate in reversed(steps):
      try:
        out = self._restore_step(like_state, candidate, with_meta)
      except DamagedCheckpoint as e:
        damaged.append(candidate)
        print(f"jaxrl-hex: {e}", file=sys.stderr)
        continue
      if damaged:
        print(f"jaxrl-hex: resuming from checkpoint {candidate}, the newest intact one", file=sys.stderr)
      return out
    raise CheckpointError(f"every kept checkpoint in {self.directory} is damaged (steps {steps}); start the run "
                          "again without --resume in a new --workdir")

  def supersede(self, after: int) -> list:
    """Moves the steps after `after` (a resume from an older one) to checkpoints/superseded/,
    where the manager does not look -> the steps moved."""
    later = [s for s in self.steps() if s > after]
    if later:
      self._mngr.wait_until_finished()
      aside = os.path.join(self.directory, "superseded")
      os.makedirs(aside, exist_ok=True)
      for s in later:
        shutil.move(os.path.join(self.directory, str(s)), os.path.join(aside, f"{s}-{os.getpid()}"))
      self._mngr.reload()
    return later

  def _restore_step(self, like_state, step, with_meta):
    try:
      saved = self._mngr.item_metadata(step)
    except Exception as e:  # noqa: BLE001 (orbax and tensorstore raise many kinds; the message is what matters)
      raise DamagedCheckpoint(step, "its metadata does not read", e) from None
    for name, tree in like_state.items():
      if saved.get(name) is None:
        raise CheckpointError(f"checkpoint {self.directory}/{step} has no '{name}'; it was saved by another "
                              "kind of run or with other settings (e.g. algo.kl_coef)")
      self._check_shapes(step, name, saved[name], tree)
    items = {name: ocp.args.StandardRestore(_abstract(tree)) for name, tree in like_state.items()}
    if with_meta:
      items["meta"] = ocp.args.JsonRestore()
    try:
      out = self._mngr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # noqa: BLE001
      raise DamagedCheckpoint(step, "it does not restore", e) from None
    return {name: out[name] for name in like_state}, (out["meta"] if with_meta else None)

  def _check_shapes(self, step, name, saved, like):
    saved_shapes = {_path(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(saved)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(like):
      key = f"{name}/{_path(path)}"
      got = saved_shapes.get(_path(path))
      if got is None:
        raise CheckpointError(f"checkpoint {self.directory}/{step} has no {key}; it was saved by another model")
      if got != tuple(leaf.shape):
        raise CheckpointError(f"checkpoint {self.directory}/{step}: {key} has shape {got} but this config builds "
                              f"{tuple(leaf.shape)}; use the model config the checkpoint was saved with")
    if len(saved_shapes) != len(jax.tree.leaves(like)):
      raise CheckpointError(f"checkpoint {self.directory}/{step}: '{name}' holds {len(saved_shapes)} arrays, "
                            f"this run {len(jax.tree.leaves(like))}; it was saved by another model or optimizer")

  def close(self):
    self._mngr.wait_until_finished()
    self._mngr.close()
