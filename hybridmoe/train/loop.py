"""The training loop: data, jitted step, evaluation, checkpoints, metrics, interruption.

`train(config, workdir)` resumes from the newest checkpoint in `workdir` if there is one.
SIGINT/SIGTERM finish the current step, save a checkpoint and return.

A run is a curriculum of stages (hybridmoe/train/stages.py; without TrainConfig.stages, one stage):
each compiles its own step for its batch shape, rebuilds the data iterator and the validation
batches at its seq_len, and hands the train state to the next; the global step keeps counting, a
checkpoint marks every switch and a stage summary goes to metrics.jsonl (split "stage").

The step runs over the mesh of `config.mesh` (all devices of all processes; one device is a mesh of size
1). Each process reads its own share of the rows (the stage's batch size, per process per step) and
the loop assembles them into global arrays; process 0 writes metrics and shows progress.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
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
from hybridmoe.train import stages as stages_lib
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
                         "batch size (DataConfig or StageConfig) × processes / TrainConfig.grad_accum, "
                         "seq_len")
    abstract = jax.eval_shape(
        lambda tokens: init_train_state(model, optimizer, tokens, train_cfg.seed), example)
    shardings = sharding.step_shardings(abstract, params_shape, mesh, mesh_cfg.rules)
    return (shardings, jit_init_state(model, optimizer, micro_batch_shape, train_cfg.seed, shardings),
            jit_train_step(model, optimizer, train_cfg, shardings), jit_eval_step(model, shardings))


def _global_batch(batch: dict[str, np.ndarray], batch_sharding) -> dict[str, jax.Array]:
    """This process's rows -> global arrays (rows of process i follow those of process i-1)."""
    return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v))
            for k, v in batch.items()}


@dataclasses.dataclass
class _Run:
    """What the stages of one `train` call share, and its progress so far."""

    config: ExperimentConfig
    ckpt: Checkpointer
    writer: Any
    bar: Any
    stop: _StopFlag
    end: int  # this call stops at this step (stop_after), if the curriculum has not ended before
    step: int
    peak: float
    bytes_per_token: float
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    last_rate: float = 0.0


@dataclasses.dataclass
class _StageRun:
    """One stage's compiled functions and data, built when the curriculum enters it."""

    stage: stages_lib.Stage
    shardings: Any
    step_fn: Any
    eval_fn: Any
    train_iter: Any
    eval_batches: list
    train_flops_per_token: float


def _stage_functions(config: ExperimentConfig, stage: stages_lib.Stage):
    micro_shape = (stage.tokens_per_step // stage.seq_len // config.train.grad_accum, stage.seq_len)
    return _compiled_functions(config.model, _step_relevant(config.train), micro_shape, config.mesh)


def _enter_stage(config: ExperimentConfig, stage: stages_lib.Stage,
                 iterator_state: dict | None) -> _StageRun:
    """Compiled functions, train iterator (at `iterator_state`) and eval batches at the stage's shape."""
    procs, rank = jax.process_count(), jax.process_index()
    shardings, _, step_fn, eval_fn = _stage_functions(config, stage)
    train_iter = data_lib.make_train_iterator(
        stage.data, long_doc_share=stage.config.long_doc_share,
        retrieval_share=stage.config.retrieval_share,
        retrieval_tasks=stage.config.retrieval_tasks,
        retrieval_answer_weight=stage.config.retrieval_answer_weight, shard_index=rank,
        shard_count=procs)
    if iterator_state is not None:
        train_iter.set_state(iterator_state)
    eval_batches = [_global_batch(b, shardings.batch) for b in data_lib.make_eval_batches(
        stage.data, config.train.eval_batches, shard_index=rank, shard_count=procs)]
    flops = model_flops_per_token(config.model, stage.seq_len)["total"] * 3
    return _StageRun(stage, shardings, step_fn, eval_fn, train_iter, eval_batches, flops)


def _initial_state(config: ExperimentConfig, first: stages_lib.Stage, ckpt: Checkpointer,
                   workdir: str):
    """(TrainState, Position): the newest checkpoint's if one restores, else fresh at stage 0.

    The state's shapes do not depend on the stage, so the first stage's init gives the template.
    """
    state = _stage_functions(config, first)[1]()
    restored = ckpt.restore_latest(abstract_like(state))
    if restored is None:
        return state, stages_lib.Position()
    step, state, data_state = restored
    position = stages_lib.Position.from_json(data_state)
    logging.info("Resumed from step %d in %s (stage %d)", step, workdir, position.stage)
    return state, position


def train(config: ExperimentConfig, workdir: str, *, progress: bool = True,
          stop_after: int | None = None) -> TrainResult:
    """Runs the curriculum (TrainConfig.stages, or one stage of DataConfig) from where `workdir`
    left off, to its end or until `stop_after` steps ran in this call (for tests)."""
    tcfg = config.train
    plan = stages_lib.plan_stages(config, jax.process_count())  # config errors before any compile
    os.makedirs(workdir, exist_ok=True)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), tcfg.keep_checkpoints)
    state, position = _initial_state(config, plan[0], ckpt, workdir)
    rank, step = jax.process_index(), int(state.step)
    peak = tcfg.peak_tflops * 1e12 or metrics_lib.measured_peak_flops(
        jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32)
    writer = metrics_lib.MetricsWriter(workdir) if rank == 0 else _NoWriter()
    end = tcfg.steps if stop_after is None else min(tcfg.steps, step + stop_after)
    with _StopFlag() as stop:
        run = _Run(config, ckpt, writer, _progress(tcfg.steps, step, progress and rank == 0), stop,
                   end, step, peak, data_lib.bytes_per_token(config.data))
        while position.stage < len(plan) and run.step < run.end and not stop.raised:
            state, position = _run_stage(run, plan[position.stage], state, position)
    ckpt.save(run.step, state, position.to_json())
    ckpt.close()
    writer.close()
    if run.bar is not None:
        run.bar.close()
    finished = position.stage == len(plan) or run.step >= tcfg.steps
    if finished and not stop.raised and rank == 0:
        print(f"done: step {run.step}, validation loss {run.last_eval.get('loss', float('nan')):.4f}, "
              f"bits/byte {run.last_eval.get('bits_per_byte', float('nan')):.4f}, "
              f"{run.last_rate:,.0f} tokens/s, workdir {workdir}")
    return TrainResult(run.step, stop.raised, run.last_eval, run.last_rate)


def _run_stage(run: _Run, stage: stages_lib.Stage, state, position: stages_lib.Position):
    """Steps through one stage until it ends (its steps, or a plateau), the call's last step or a
    signal. Returns the state and the position to save: the next stage's start once it ended."""
    tcfg = run.config.train
    sr = _enter_stage(run.config, stage, position.iterator)
    stage_end = position.start_step + stage.config.steps
    meter, plateau = metrics_lib.Throughput(), position.plateau
    if run.bar is not None and tcfg.stages:
        run.bar.set_description(f"stage {stage.index} (T={stage.seq_len})")
    while True:
        state, m = sr.step_fn(state, _global_batch(next(sr.train_iter), sr.shardings.batch))
        run.step += 1
        meter.add(stage.tokens_per_step)
        _check_finite(run, state, m, _current(position, plateau, sr))
        if run.step % tcfg.log_every == 0 or run.step in (run.end, stage_end):
            _log_train(run, sr, m, meter)
        if run.step % tcfg.eval_every == 0 or run.step >= stage_end:
            _validate(run, sr, state)
            plateau = plateau.update(run.last_eval["loss"], stage.config.min_delta)
        if run.bar is not None:
            run.bar.update(1)
        here = _current(position, plateau, sr)
        if run.step >= stage_end or stage.ends_early(plateau):
            ended_by = "steps" if run.step >= stage_end else "plateau"
            return state, _finish_stage(run, stage, state, here, ended_by)
        if run.stop.raised or run.step >= run.end:
            return state, here
        if run.step % tcfg.checkpoint_every == 0:
            run.ckpt.save(run.step, state, here.to_json())


def _current(position: stages_lib.Position, plateau: stages_lib.Plateau,
             sr: _StageRun) -> stages_lib.Position:
    return dataclasses.replace(position, plateau=plateau, iterator=sr.train_iter.get_state())


def _check_finite(run: _Run, state, m, here: stages_lib.Position) -> None:
    """The non-finite guard: the step was skipped (logged), or the run stops with a checkpoint."""
    if bool(m["finite"]):
        return
    if run.config.train.on_nonfinite == "stop":
        run.ckpt.save(run.step - 1, state, here.to_json())
        raise NonFiniteError(f"non-finite loss or gradient at step {run.step}")
    logging.warning("Non-finite loss or gradient at step %d: step skipped "
                    "(%d skipped so far).", run.step, int(m["skipped_steps"]))


def _log_train(run: _Run, sr: _StageRun, m, meter: metrics_lib.Throughput) -> None:
    run.last_rate = meter.rate()
    record = _train_record(m, run.bytes_per_token, run.last_rate, sr.train_flops_per_token, run.peak)
    run.writer.write(run.step, record)
    if run.bar is not None:
        run.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{run.last_rate:,.0f}")


def _validate(run: _Run, sr: _StageRun, state) -> None:
    """Validation loss at the stage's seq_len (and batch size), written and logged."""
    run.last_eval = evaluate(sr.eval_fn, state.params, state.router, sr.eval_batches,
                             run.bytes_per_token)
    run.writer.write(run.step, run.last_eval, split="validation")
    logging.info("step %d validation loss %.4f bits/byte %.4f", run.step,
                 run.last_eval["loss"], run.last_eval["bits_per_byte"])


def _finish_stage(run: _Run, stage: stages_lib.Stage, state, here: stages_lib.Position,
                  ended_by: str) -> stages_lib.Position:
    """Logs the stage summary and checkpoints the switch to the next stage.

    Without TrainConfig.stages the one stage stays current, iterator and all, as before curricula
    existed: raising TrainConfig.steps in a finished workdir trains on from where it stopped.
    """
    if not run.config.train.stages:
        run.ckpt.save(run.step, state, here.to_json())
        return here
    summary = stages_lib.stage_summary(stage, here, run.step, run.last_eval, ended_by)
    run.writer.write(run.step, summary, split="stage")
    logging.info("stage %d done (%s): seq_len %d, %d steps, validation loss %.4f",
                 stage.index, ended_by, stage.seq_len, summary["steps"], summary["validation_loss"])
    following = here.next_stage(run.step)
    run.ckpt.save(run.step, state, following.to_json())
    return following


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
