"""The context-length curriculum: stages resolved from the config, and where a run stands in them.

A run is a sequence of stages (`TrainConfig.stages`; none: one stage made of DataConfig and
TrainConfig.steps). The train state carries over from stage to stage unchanged (its shapes do not
depend on the sequence length) and the global step keeps counting; the data iterator and the
validation batches are rebuilt at each stage's seq_len and batch size.

Where a run stands (stage, the step that stage began at, its plateau tracker and its data
iterator's position) is a `Position`, saved as JSON beside every checkpoint: a run resumed in the
same workdir continues in the right stage, at the right step, with the right data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridmoe.config import DataConfig, ExperimentConfig, StageConfig


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int
    config: StageConfig
    data: DataConfig  # the stage's seq_len and rows per process; the rest as DataConfig
    tokens_per_step: int  # global

    @property
    def seq_len(self) -> int:
        return self.data.seq_len

    def ends_early(self, plateau: Plateau) -> bool:
        """True when the stage's advance rule says the curriculum should move on now."""
        return self.config.advance_if == "plateau" and plateau.stale >= self.config.patience


def plan_stages(config: ExperimentConfig, processes: int) -> tuple[Stage, ...]:
    """The run's stages with their batch sizes resolved, every one checked before any compiles."""
    data, train = config.data, config.train
    stage_configs = train.stages or (
        StageConfig(seq_len=data.seq_len, steps=train.steps, batch_size=data.batch_size),)
    plan = []
    for index, stage in enumerate(stage_configs):
        rows = stage.rows_per_process(data, processes)
        if rows * processes % train.grad_accum:
            raise ValueError(
                f"TrainConfig.grad_accum must divide every stage's global batch, got "
                f"{train.grad_accum} for stage {index} ({rows} rows × {processes} processes "
                f"at seq_len={stage.seq_len})")
        stage_data = dataclasses.replace(data, seq_len=stage.seq_len, batch_size=rows)
        plan.append(Stage(index, stage, stage_data, rows * processes * stage.seq_len))
    return tuple(plan)


@dataclasses.dataclass(frozen=True)
class Plateau:
    """A stage's validation losses so far, reduced to what `advance_if="plateau"` needs."""

    best: float | None = None
    stale: int = 0  # validations in a row that did not beat `best` by more than min_delta

    def update(self, loss: float, min_delta: float) -> Plateau:
        if self.best is None or loss < self.best - min_delta:
            return Plateau(loss, 0)
        return Plateau(self.best, self.stale + 1)


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a run stands in its curriculum; `stage == len(plan)` once the last stage is done."""

    stage: int = 0
    start_step: int = 0  # the global step at which this stage began
    plateau: Plateau = Plateau()
    iterator: dict | None = None  # the stage's data iterator state; None: its first batch

    def next_stage(self, step: int) -> Position:
        return Position(self.stage + 1, step)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Position:
        if "stage" not in data:  # checkpoints written before curricula hold the iterator state alone
            return cls(iterator=data)
        return cls(data["stage"], data["start_step"], Plateau(**data["plateau"]), data["iterator"])


def stage_summary(stage: Stage, position: Position, step: int, validation: dict[str, float],
                  ended_by: str) -> dict[str, Any]:
    """The record logged (split "stage") when a stage ends; `ended_by` is "steps" or "plateau"."""
    return {
        "stage": stage.index, "seq_len": stage.seq_len, "batch_size": stage.data.batch_size,
        "tokens_per_step": stage.tokens_per_step, "long_doc_share": stage.config.long_doc_share,
        "retrieval_share": stage.config.retrieval_share,
        "retrieval_answer_weight": stage.config.retrieval_answer_weight,
        "eval_lengths": list(stage.config.eval_lengths), "start_step": position.start_step,
        "steps": step - position.start_step, "planned_steps": stage.config.steps,
        "ended_by": ended_by, "validation_loss": validation["loss"],
        "validation_bits_per_byte": validation["bits_per_byte"],
    }
