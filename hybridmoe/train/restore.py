"""Read a trained run back: the config's model with the newest checkpoint's state."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from hybridmoe.config import ExperimentConfig
from hybridmoe.model import build_model
from hybridmoe.train.checkpoint import Checkpointer, abstract_like
from hybridmoe.train.optimizer import make_optimizer
from hybridmoe.train.step import TrainState, init_train_state


def restore_state(config: ExperimentConfig, workdir: str):
    """(model, step, TrainState) from the newest checkpoint in workdir/checkpoints that restores."""
    model = build_model(config.model)
    dcfg, tcfg = config.data, config.train
    example = jnp.zeros((dcfg.batch_size // tcfg.grad_accum, dcfg.seq_len), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), example)["params"]
    template = jax.eval_shape(lambda: init_train_state(model, make_optimizer(tcfg, shapes), example,
                                                       tcfg.seed))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), tcfg.keep_checkpoints)
    try:
        restored = ckpt.restore_latest(abstract_like(template))
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no restorable checkpoint under {workdir}/checkpoints")
    step, state, _ = restored
    return model, step, state
