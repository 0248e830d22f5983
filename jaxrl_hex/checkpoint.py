"""Orbax checkpoints of a run: model, optimizer, policy version, data position and RNG.

Orbax writes each step to a temporary directory and renames it when complete, so a run
killed mid-save leaves only a step that latest_step() ignores: resume takes the previous one. A
step damaged after it was written (a truncated shard, garbage metadata) fails to restore; resume
then says so in one line and takes the newest kept step that restores, and the steps after it
move to checkpoints/superseded/, so the run's new saves do not collide with them.

The best checkpoint (train.keep_best: the step whose evaluation beat every earlier one) is kept
beside the last K and named by checkpoints/best.json, which is written only once that step is
complete, so it always names a step that is there; `--step=best` picks it.
"""
import argparse
import json
import os
import shutil
import sys

import jax
import orbax.checkpoint as ocp

from jaxrl_hex.errors import UserError

STATE_ITEMS = ("params", "opt_state", "ref_params", "critic")  # critic: {params, opt_state} (PPO)
BEST_FILE = "best.json"  # {step, metric, mode, value}: the run's best evaluation and its checkpoint


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


def step_arg(text: str):
  """The value of a command's --step: a number, `best` or `latest` -> the step, "best" or None (the latest)."""
  if text in ("best", "latest"):
    return None if text == "latest" else text
  try:
    step = int(text)
  except ValueError:
    step = -1
  if step < 0:
    raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint: pass a step number, best or latest")
  return step


def split_run(ref: str):
  """A run and the checkpoint to take from it, as init_from names them: WORKDIR (the latest),
  WORKDIR:best or WORKDIR:N -> (workdir, step: None, "best" or N)."""
  workdir, colon, which = ref.rpartition(":")
  if colon and (which == "best" or which.isdigit()):
    return workdir, step_arg(which)
  return ref, None


def read_best(directory: str):
  """checkpoints/best.json -> {step, metric, mode, value}, or None where the run kept no best."""
  path = os.path.join(directory, BEST_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      best = json.load(f)
    int(best["step"])
  except (ValueError, KeyError, TypeError) as e:  # written atomically: only a hand edit gets here
    raise CheckpointError(f"{path} does not read ({type(e).__name__}: {e}); delete it (the run writes it again "
                          "at its next best evaluation) and pass --step=N") from None
  return best


class _Named:
  """An Orbax preservation policy: keeps the steps `steps()` names, whatever their age."""

  def __init__(self, steps):
    self.steps = steps

  def should_preserve(self, checkpoints, *, context):
    del context
    named = self.steps()
    return [c.step in named for c in checkpoints]


class Checkpointer:

  def __init__(self, directory: str, keep: int = 2):
    self.directory = os.path.abspath(directory)
    self.keep = keep
    self._best = read_best(self.directory)  # the record in best.json
    self._pending = None  # a newer best whose save is in flight: best.json names it once the step is complete
    # handlers named up front, so a fresh process can read a checkpoint's metadata before restoring
    handlers = {name: ocp.StandardCheckpointHandler() for name in STATE_ITEMS}
    handlers["meta"] = ocp.JsonCheckpointHandler()
    managers = ocp.checkpoint_managers
    keeps = managers.AnyPreservationPolicy([managers.LatestN(keep), _Named(self._kept_best)])
    self._mngr = ocp.CheckpointManager(self.directory, item_handlers=handlers,
                                       options=ocp.CheckpointManagerOptions(preservation_policy=keeps, create=True))

  def latest_step(self):
    return self._mngr.latest_step()

  def save(self, step: int, state: dict, meta: dict):
    """state: {name in STATE_ITEMS: pytree of jax arrays}; meta: JSON (version, data position, rng,
    and under "best" the run's best evaluation so far, {step, metric, mode, value}, whose checkpoint
    is kept beside the last K)."""
    self._settle()
    best = meta.get("best")
    if best and best != self._best:
      self._pending = dict(best)
    items = {name: ocp.args.StandardSave(tree) for name, tree in state.items()}
    self._mngr.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items))

  def wait(self):
    self._settle()

  def steps(self) -> list:
    return sorted(self._mngr.all_steps())

  @property
  def best(self):
    """best.json's record where its step is kept, else None."""
    return self._best if self._best and self._best["step"] in self.steps() else None

  def resolve(self, step, field=None) -> int:
    """A step as a command names it (None: the newest, a number, or "best") -> its number, which is kept.
    `field`: what named the step, for errors (default --step=STEP; init_from=WORKDIR:best names its own)."""
    field = field or f"--step={step}"
    steps = self.steps()
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory}: the run saved none yet")
    if step is None:
      return steps[-1]
    if step == "best":
      if self.best is None:
        raise CheckpointError(f"{field}: {self.directory} holds no best checkpoint (no {BEST_FILE}): the run "
                              "trained without train.keep_best=True or has not evaluated since; pass a step of "
                              f"{steps} or the latest")
      return self.best["step"]
    if step not in steps:
      raise CheckpointError(f"{field}: no checkpoint {step} in {self.directory}; kept steps: {steps}")
    return step

  def meta(self, step: int) -> dict:
    """The JSON saved with a step (no arrays read)."""
    try:
      return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 (orbax and tensorstore raise many kinds; the message is what matters)
      raise DamagedCheckpoint(step, "its metadata does not read", e) from None

  def restore(self, like_state: dict, step=None, with_meta=True, field=None):
    """Restores the items named in `like_state` onto its shardings (the live layout of this run)
    -> (state, meta). `step` None: the newest step that restores, after a line on stderr for
    each damaged newer one; a given step (a number, or "best") must restore (`field`: as resolve's).
    The meta's "best" is dropped where its checkpoint is no longer kept."""
    steps = self.steps()
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory}: the run saved none yet; start it again without "
                            "--resume, or point --workdir at a run that saved one")
    if step is not None:
      return self._restore_step(like_state, self.resolve(step, field), with_meta)
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
      if self._best and self._best["step"] in later:  # the best as of `after`, which its meta holds
        self._pending, self._best = None, self.meta(after).get("best")
        if self._best and self._best["step"] in self.steps():
          self._write_best()
        else:
          self._best = None
          os.remove(os.path.join(self.directory, BEST_FILE))
    return later

  def _kept_best(self) -> set:
    """The steps rotation keeps beside the last K: best.json's, and a newer best's until best.json names it."""
    return {r["step"] for r in (self._best, self._pending) if r}

  def _settle(self):
    """Once the save in flight is complete, a newer best goes to best.json, and the best it replaces,
    kept by rotation until then, is deleted unless it is one of the last K."""
    self._mngr.wait_until_finished()
    new, self._pending = self._pending, None
    steps = self.steps()
    if new is None or new["step"] not in steps:  # a failed save: best.json keeps naming the step it named
      return
    old, self._best = self._best, new
    self._write_best()
    if old and old["step"] != new["step"] and old["step"] in steps[:-self.keep]:
      self._mngr.delete(old["step"])

  def _write_best(self):
    if jax.process_index() == 0:  # one writer; every process rotates alike
      path = os.path.join(self.directory, BEST_FILE)
      with open(path + ".tmp", "w") as f:
        json.dump(self._best, f)
      os.replace(path + ".tmp", path)

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
    meta = out["meta"] if with_meta else None
    if meta and meta.get("best") and meta["best"]["step"] not in self.steps():
      meta = {k: v for k, v in meta.items() if k != "best"}
    return {name: out[name] for name in like_state}, meta

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
    self._settle()
    self._mngr.close()
