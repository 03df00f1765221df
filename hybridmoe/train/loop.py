"""The training loop: data, jitted step, evaluation, checkpoints, metrics, interruption.

`train(config, workdir)` resumes from the newest checkpoint in `workdir` if there is one.
SIGINT/SIGTERM finish the current step, save a checkpoint and return.

The step runs over the mesh of `config.mesh` (all devices of all processes; one device is a mesh of size
1). Each process reads its own share of the rows (DataConfig.batch_size rows per process per step) and
the loop assembles them into global arrays; process 0 writes metrics and shows progress.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from hybridmoe import data as data_lib
from hybridmoe import sharding
from hybridmoe.config import ExperimentConfig, MeshConfig, TrainConfig
from hybridmoe.model import build_model
from hybridmoe.train import metrics as metrics_lib
from hybridmoe.train.checkpoint import Checkpointer, abstract_like
from hybridmoe.train.optimizer import make_optimizer
from hybridmoe.train.step import (init_train_state, jit_eval_step, jit_init_state, jit_train_step,
                                  model_flops_per_token)


class NonFiniteError(RuntimeError):
    pass


@dataclasses.dataclass
class TrainResult:
    step: int
    interrupted: bool
    final_eval: dict[str, float]
    tokens_per_s: float


class _StopFlag:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps."""

    def __init__(self):
        self.raised = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a notebook worker)
                pass
        return self

    def _handle(self, signum, frame):
        logging.warning("Signal %d received: saving a checkpoint and stopping.", signum)
        self.raised = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def evaluate(eval_fn, params, router, batches, bytes_per_token: float) -> dict[str, float]:
    total, count = 0.0, 0.0
    for batch in batches:
        loss_sum, tokens = eval_fn(params, router, batch)
        total += float(loss_sum)
        count += float(tokens)
    loss = total / max(count, 1.0)
    return {"loss": loss, "bits_per_byte": loss / math.log(2.0) / bytes_per_token}


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def _step_relevant(tcfg: TrainConfig) -> TrainConfig:
    """The config with fields the compiled step never reads reset, so changing them reuses it."""
    defaults = TrainConfig()
    return dataclasses.replace(tcfg, **{name: getattr(defaults, name) for name in (
        "on_nonfinite", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_batches",
        "log_every", "peak_tflops", "stages")})


class _NoWriter:
    """Metrics sink of processes other than 0 (process 0 writes the files)."""

    def write(self, *args, **kwargs):
        pass

    def close(self):
        pass


@functools.lru_cache(maxsize=4)
def _compiled_functions(model_cfg, train_cfg, micro_batch_shape, mesh_cfg: MeshConfig):
    """Shardings and jitted init/step/eval functions, shared by runs of one config in a process
    (a resumed run, sweep points that differ only in data or steps) so they compile once."""
    model = build_model(model_cfg)
    example = jax.ShapeDtypeStruct(micro_batch_shape, jnp.int32)
    params_shape = jax.eval_shape(model.init, jax.random.key(0), example)["params"]
    optimizer = make_optimizer(train_cfg, params_shape)
    mesh = sharding.make_mesh(mesh_cfg)
    sharding.check_batch(micro_batch_shape, mesh_cfg.rules, sharding.axis_sizes(mesh),
                         "DataConfig.batch_size × processes / TrainConfig.grad_accum, DataConfig.seq_len")
    abstract = jax.eval_shape(
        lambda tokens: init_train_state(model, optimizer, tokens, train_cfg.seed), example)
    shardings = sharding.step_shardings(abstract, params_shape, mesh, mesh_cfg.rules)
    return (shardings, jit_init_state(model, optimizer, micro_batch_shape, train_cfg.seed, shardings),
            jit_train_step(model, optimizer, train_cfg, shardings), jit_eval_step(model, shardings))


def _global_batch(batch: dict[str, np.ndarray], batch_sharding) -> dict[str, jax.Array]:
    """This process's rows -> global arrays (rows of process i follow those of process i-1)."""
    return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v))
            for k, v in batch.items()}


def train(config: ExperimentConfig, workdir: str, *, progress: bool = True,
          stop_after: int | None = None) -> TrainResult:
    """Trains to config.train.steps (or until `stop_after` steps in this call, for tests)."""
    tcfg, dcfg = config.train, config.data
    os.makedirs(workdir, exist_ok=True)
    procs, rank = jax.process_count(), jax.process_index()
    micro_shape = (dcfg.batch_size * procs // tcfg.grad_accum, dcfg.seq_len)
    shardings, init_fn, step_fn, eval_fn = _compiled_functions(
        config.model, _step_relevant(tcfg), micro_shape, config.mesh)
    state = init_fn()
    train_iter = data_lib.make_train_iterator(dcfg, shard_index=rank, shard_count=procs)
    eval_batches = [_global_batch(b, shardings.batch) for b in data_lib.make_eval_batches(
        dcfg, tcfg.eval_batches, shard_index=rank, shard_count=procs)]
    bytes_per_token = data_lib.bytes_per_token(dcfg)

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), tcfg.keep_checkpoints)
    restored = ckpt.restore_latest(abstract_like(state))
    if restored is not None:
        step0, state, data_state = restored
        train_iter.set_state(data_state)
        logging.info("Resumed from step %d in %s", step0, workdir)

    flops = model_flops_per_token(config.model, dcfg.seq_len)
    peak = tcfg.peak_tflops * 1e12 or metrics_lib.measured_peak_flops(
        jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32)
    writer = metrics_lib.MetricsWriter(workdir) if rank == 0 else _NoWriter()
    tokens_per_step = dcfg.batch_size * procs * dcfg.seq_len
    step = int(state.step)
    end = tcfg.steps if stop_after is None else min(tcfg.steps, step + stop_after)
    bar = _progress(tcfg.steps, step, progress and rank == 0)
    meter, last_rate, last_eval = metrics_lib.Throughput(), 0.0, {}
    interrupted = False

    with _StopFlag() as stop:
        while step < end:
            batch = _global_batch(next(train_iter), shardings.batch)
            state, m = step_fn(state, batch)
            step += 1
            meter.add(tokens_per_step)
            if not bool(m["finite"]):
                if tcfg.on_nonfinite == "stop":
                    ckpt.save(step - 1, state, train_iter.get_state())
                    raise NonFiniteError(f"non-finite loss or gradient at step {step}")
                logging.warning("Non-finite loss or gradient at step %d: step skipped "
                                "(%d skipped so far).", step, int(m["skipped_steps"]))
            if step % tcfg.log_every == 0 or step == end:
                last_rate = meter.rate()
                record = _train_record(m, bytes_per_token, last_rate, flops["total"] * 3, peak)
                writer.write(step, record)
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{last_rate:,.0f}")
            if step % tcfg.eval_every == 0 or step == tcfg.steps:
                last_eval = evaluate(eval_fn, state.params, state.router, eval_batches,
                                     bytes_per_token)
                writer.write(step, last_eval, split="validation")
                logging.info("step %d validation loss %.4f bits/byte %.4f", step,
                             last_eval["loss"], last_eval["bits_per_byte"])
            if bar is not None:
                bar.update(1)
            if stop.raised:
                interrupted = True
                break
            if step % tcfg.checkpoint_every == 0:
                ckpt.save(step, state, train_iter.get_state())
    ckpt.save(step, state, train_iter.get_state())
    ckpt.close()
    writer.close()
    if bar is not None:
        bar.close()
    if step >= tcfg.steps and not interrupted and rank == 0:
        print(f"done: step {step}, validation loss {last_eval.get('loss', float('nan')):.4f}, "
              f"bits/byte {last_eval.get('bits_per_byte', float('nan')):.4f}, "
              f"{last_rate:,.0f} tokens/s, workdir {workdir}")
    return TrainResult(step, interrupted, last_eval, last_rate)


def _train_record(m: dict[str, Any], bytes_per_token: float, tokens_per_s: float,
                  train_flops_per_token: float, peak: float) -> dict[str, Any]:
    record = {k: v for k, v in m.items() if k not in ("finite", "router")}
    record = metrics_lib.flatten(record)
    record["bits_per_byte"] = record.pop("bits_per_token") / bytes_per_token
    record["tokens_per_s"] = tokens_per_s
    record["mfu"] = tokens_per_s * train_flops_per_token / peak
    record["router"] = {layer: {k: v for k, v in stats.items()}
                        for layer, stats in m["router"].items()}
    return record
