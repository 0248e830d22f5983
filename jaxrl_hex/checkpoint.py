"""Orbax checkpoints of a run: model, optimizer, policy version, data position and RNG.

Orbax writes each step to a temporary directory and renames it when complete, so a run
killed mid-save leaves only a step that latest_step() ignores: resume takes the previous one.
"""
import os

import jax
import orbax.checkpoint as ocp

from jaxrl_hex.errors import UserError

STATE_ITEMS = ("params", "opt_state", "ref_params", "critic")  # critic: {params, opt_state} (PPO)


class CheckpointError(UserError):
  pass


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

  def restore(self, like_state: dict, step=None, with_meta=True):
    """Restores the items named in `like_state` onto its shardings (the live layout of this run)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.directory}; start the run without --resume "
                            "(or point --workdir at a run that saved one)")
    saved = self._mngr.item_metadata(step)
    for name, tree in like_state.items():
      if saved.get(name) is None:
        raise CheckpointError(f"checkpoint {self.directory}/{step} has no '{name}'; it was saved by another "
                              "kind of run or with other settings (e.g. algo.kl_coef)")
      self._check_shapes(step, name, saved[name], tree)
    items = {name: ocp.args.StandardRestore(_abstract(tree)) for name, tree in like_state.items()}
    if with_meta:
      items["meta"] = ocp.args.JsonRestore()
    out = self._mngr.restore(step, args=ocp.args.Composite(**items))
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
