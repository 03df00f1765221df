"""Checkpoints with orbax: the whole TrainState plus the data iterator's position.

Saves are synchronous, so a checkpoint written on interruption is complete before exit. A
latest checkpoint that fails to restore falls back to the previous one, with a warning.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
    def __init__(self, directory: str, keep: int):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=False))

    def save(self, step: int, state: Any, data_state: dict | None) -> None:
        if step in self.manager.all_steps():
            return
        items = {"state": ocp.args.StandardSave(state)}
        if data_state is not None:
            items["data"] = ocp.args.JsonSave(data_state)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.manager.wait_until_finished()

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict | None] | None:
        """(step, state, data_state) of the newest checkpoint that restores, or None."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=ocp.args.JsonRestore()))
                return step, restored["state"], restored["data"]
            except Exception as err:  # noqa: BLE001 - any damage means "try the previous one"
                logging.warning("Checkpoint at step %d in %s could not be restored (%s: %s); "
                                "falling back to the previous one.", step, self.directory,
                                type(err).__name__, err)
        return None

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def close(self) -> None:
        self.manager.close()


def abstract_like(state: Any) -> Any:
    return jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
