"""Orbax checkpoints of a run: every array of the training state plus a small JSON record
(step, counters, curriculum state), saved asynchronously every N steps, the latest K kept.

Orbax writes each step to a temporary directory and renames it only when complete, so a save
killed half-way never damages the last good checkpoint. Restore goes through an abstract target
(shapes, dtypes and shardings of the current run), so a checkpoint can be restored onto another
mesh.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, directory: str, *, keep: int = 2, save_every: int = 1):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=save_every,
                                           enable_async_checkpointing=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, record: dict, *, force: bool = False) -> bool:
    """Saves if `step` is on the save interval (or `force`); a step already saved is kept."""
    if step in self.manager.all_steps():
      return False
    return self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)), force=force)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Restores onto the shapes/dtypes/shardings of `abstract_state` (arrays or
    jax.ShapeDtypeStruct leaves)."""
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), record=ocp.args.JsonRestore()))
    return restored["state"], restored["record"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
