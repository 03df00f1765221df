"""Context-length curriculum: stage switches, batch adaptation, plateau rule, exact resume, configs."""

import dataclasses

import jax
import numpy as np
import pytest

from hybridmoe import data as data_lib
from hybridmoe import load_config
from hybridmoe.config import DataConfig, StageConfig, TrainConfig
from hybridmoe.train import loop
from hybridmoe.train.stages import Plateau, Position, plan_stages
from tests.train.test_training import MICRO, read_metrics

# Two stages at MICRO's 4 × 64 = 256 tokens per step: 8 rows of 32, then 4 rows of 64. One layer (MLA)
# keeps the compiles short; the curriculum does not depend on the layer kinds.
STAGES = [
    "ModelConfig.num_layers = 1",
    "s1/StageConfig.seq_len = 32", "s1/StageConfig.steps = 3",
    "s2/StageConfig.seq_len = 64", "s2/StageConfig.steps = 3",
    "s2/StageConfig.long_doc_share = 0.5", "s2/StageConfig.eval_lengths = (64, 128)",
    "s2/StageConfig.retrieval_share = 0.25", "s2/StageConfig.retrieval_tasks = ('niah_single',)",
    "TrainConfig.stages = (@s1/StageConfig(), @s2/StageConfig())",
]


def staged_config(*extra):
    return load_config(["configs/tiny.gin"], MICRO + STAGES + list(extra))


def records(workdir, split):
    return [r for r in read_metrics(workdir) if r["split"] == split]


def host(tree):
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def train_recording_steps(monkeypatch, workdir, **kwargs):
    """loop.train of the staged config, returning every step's batch and params (before, after)
    and the shape of every validation batch."""
    calls, eval_shapes = [], []
    real = loop._compiled_functions

    def spying(*args):
        shardings, init_fn, step_fn, eval_fn = real(*args)

        def step(state, batch):
            before = host(state.params)  # read before the step donates the state
            new_state, metrics = step_fn(state, batch)
            calls.append({"tokens": np.asarray(batch["tokens"]), "before": before,
                          "after": host(new_state.params)})
            return new_state, metrics

        def evaluate(params, router, batch):
            eval_shapes.append(batch["tokens"].shape)
            return eval_fn(params, router, batch)

        return shardings, init_fn, step, evaluate

    monkeypatch.setattr(loop, "_compiled_functions", spying)
    result = loop.train(staged_config(), workdir, progress=False, **kwargs)
    monkeypatch.undo()
    return calls, eval_shapes, result


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted curriculum run: (workdir, steps, validation batch shapes, TrainResult)."""
    workdir = str(tmp_path_factory.mktemp("straight"))
    with pytest.MonkeyPatch.context() as patch:
        calls, eval_shapes, result = train_recording_steps(patch, workdir)
    return workdir, calls, eval_shapes, result


def test_stage_switch_carries_state_and_rebuilds_data(straight):
    workdir, calls, eval_shapes, result = straight
    assert result.step == 6
    assert [c["tokens"].shape for c in calls] == [(8, 32)] * 3 + [(4, 64)] * 3
    assert eval_shapes == [(8, 32)] * 2 + [(4, 64)] * 2  # 2 validation batches after each stage
    # Stage 2 starts from exactly the params stage 1 ended with.
    assert_trees_equal(calls[2]["after"], calls[3]["before"])
    # ... and from the first batch of its own data stream (seq_len 64, half long-document rows,
    # a quarter retrieval rows).
    stage2 = plan_stages(staged_config(), 1)[1]
    first = next(data_lib.make_train_iterator(stage2.data, long_doc_share=0.5,
                                              retrieval_share=0.25,
                                              retrieval_tasks=("niah_single",)))
    np.testing.assert_array_equal(calls[3]["tokens"], first["tokens"])

    summaries = records(workdir, "stage")
    validation = {r["step"]: r["loss"] for r in records(workdir, "validation")}
    assert [(s["stage"], s["seq_len"], s["batch_size"], s["tokens_per_step"], s["start_step"],
             s["steps"], s["ended_by"], s["step"]) for s in summaries] == [
        (0, 32, 8, 256, 0, 3, "steps", 3), (1, 64, 4, 256, 3, 3, "steps", 6)]
    assert [s["validation_loss"] for s in summaries] == [validation[3], validation[6]]
    assert summaries[1]["eval_lengths"] == [64, 128]


def test_resume_mid_curriculum_matches_uninterrupted_run(straight, tmp_path, monkeypatch):
    straight_dir, straight_calls, _, _ = straight
    workdir = str(tmp_path / "split")
    calls = []
    for stop_after, stopped_at in ((2, 2), (3, 5), (None, 6)):  # inside stage 1, across the switch
        more, _, result = train_recording_steps(monkeypatch, workdir, stop_after=stop_after)
        assert result.step == stopped_at
        calls += more
    losses = lambda w, split: [(r["step"], r["loss"]) for r in records(w, split)]
    assert losses(workdir, "train") == losses(straight_dir, "train")
    assert losses(workdir, "validation") == losses(straight_dir, "validation")
    assert records(workdir, "stage") == records(straight_dir, "stage")
    for got, want in zip(calls, straight_calls, strict=True):  # same batches, same params
        np.testing.assert_array_equal(got["tokens"], want["tokens"])
        assert_trees_equal(got["after"], want["after"])


def _run_with_losses(tmp_path, monkeypatch, losses):
    """A curriculum whose first stage may end on a plateau, with validation losses `losses`."""
    sequence = iter(losses)
    monkeypatch.setattr(loop, "evaluate", lambda *args: {"loss": next(sequence),
                                                         "bits_per_byte": 1.0})
    config = staged_config("TrainConfig.eval_every = 1", "s1/StageConfig.advance_if = 'plateau'",
                           "s1/StageConfig.patience = 1", "s1/StageConfig.min_delta = 0.01")
    workdir = str(tmp_path)
    result = loop.train(config, workdir, progress=False)
    return result, [(s["steps"], s["ended_by"]) for s in records(workdir, "stage")]


def test_plateau_ends_a_stage_early(tmp_path, monkeypatch):
    result, stages = _run_with_losses(tmp_path, monkeypatch, [2.0, 1.995] + [1.0] * 4)
    assert stages == [(2, "plateau"), (3, "steps")]
    assert result.step == 5


def test_falling_validation_loss_runs_the_stage_to_its_end(tmp_path, monkeypatch):
    _, stages = _run_with_losses(tmp_path, monkeypatch, [2.0, 1.9, 1.8, 1.0, 1.0, 1.0])
    assert stages == [(3, "steps"), (3, "steps")]


def test_plateau_rule():
    def stale_counts(losses, min_delta):
        plateau, out = Plateau(), []
        for loss in losses:
            plateau = plateau.update(loss, min_delta)
            out.append(plateau.stale)
        return out

    assert stale_counts([3.0, 2.5, 2.0, 1.5], 0.1) == [0, 0, 0, 0]
    assert stale_counts([3.0, 2.95, 2.92, 2.8], 0.1) == [0, 1, 2, 0]  # 2.8 beats 3.0 by 0.2
    assert stale_counts([3.0, 3.1, 2.99], 0.0) == [0, 1, 0]
    stage = plan_stages(staged_config("s1/StageConfig.advance_if = 'plateau'",
                                      "s1/StageConfig.patience = 2"), 1)[0]
    assert not stage.ends_early(Plateau(2.0, 1)) and stage.ends_early(Plateau(2.0, 2))
    assert not dataclasses.replace(stage, config=StageConfig(seq_len=32)).ends_early(Plateau(2.0, 9))


def test_batch_adapts_to_keep_tokens_per_step():
    data = DataConfig(seq_len=512, batch_size=8)
    rows = lambda stage, procs=1: stage.rows_per_process(data, procs)
    assert [rows(StageConfig(seq_len=n)) for n in (256, 512, 2048, 4096)] == [16, 8, 2, 1]
    assert rows(StageConfig(seq_len=1024), procs=2) == 4  # 8 × 2 × 512 tokens over 2 processes
    assert rows(StageConfig(seq_len=1024, batch_size=3)) == 3
    assert rows(StageConfig(seq_len=1024, tokens_per_step=16384)) == 16
    with pytest.raises(ValueError, match=r"StageConfig.tokens_per_step must give a whole number ≥ 1 "
                                         r"of rows of seq_len=8192 .* got 0 \(the base "
                                         r"DataConfig.batch_size=8 .* = 4096 tokens\)"):
        rows(StageConfig(seq_len=8192))
    with pytest.raises(ValueError, match="seq_len=3000 for each of 1 processes, got 0"):
        rows(StageConfig(seq_len=3000))
    with pytest.raises(ValueError, match="seq_len=1024 for each of 3 processes, got 5120"):
        rows(StageConfig(seq_len=1024, tokens_per_step=5120), procs=3)


@pytest.mark.parametrize("fields, message", [
    ({"batch_size": 2, "tokens_per_step": 1024}, "StageConfig.tokens_per_step must be 0 when batch_size"),
    ({"seq_len": 512, "tokens_per_step": 1000}, "StageConfig.tokens_per_step must be a multiple of "
                                                "seq_len=512"),
    ({"long_doc_share": 1.5}, r"StageConfig.long_doc_share must be in \[0.0, 1.0\], got 1.5"),
    ({"retrieval_share": 1.5}, r"StageConfig.retrieval_share must be in \[0.0, 1.0\], got 1.5"),
    ({"retrieval_share": -0.1}, r"StageConfig.retrieval_share must be in \[0.0, 1.0\], got -0.1"),
    ({"long_doc_share": 0.75, "retrieval_share": 0.5},
     "StageConfig.retrieval_share must be at most 1 - long_doc_share = 0.25 .*got 0.5"),
    ({"retrieval_tasks": ("niah_single", "needle")},
     "StageConfig.retrieval_tasks must be one of 'niah_single', .*got 'needle'"),
    ({"retrieval_tasks": ()}, "StageConfig.retrieval_tasks must be a non-empty tuple"),
    ({"retrieval_answer_weight": 0.0},
     r"StageConfig.retrieval_answer_weight must be in \(0.0, 1000000.0\], got 0.0"),
    ({"eval_lengths": (512, 0)}, "StageConfig.eval_lengths must be a tuple of positive integers"),
    ({"advance_if": "loss"}, "StageConfig.advance_if must be one of 'never', 'plateau'"),
    ({"patience": 0}, "StageConfig.patience must be a positive integer, got 0"),
    ({"min_delta": -0.1}, r"StageConfig.min_delta must be in \[0.0, 1000000.0\], got -0.1"),
])
def test_stage_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        StageConfig(**fields)


def test_curriculum_config_errors():
    with pytest.raises(ValueError, match="TrainConfig.steps must be the stages' total 5"):
        TrainConfig(steps=6, stages=(StageConfig(steps=2), StageConfig(steps=3)))
    with pytest.raises(ValueError, match="TrainConfig.stages must be a tuple of StageConfig"):
        TrainConfig(steps=2, stages=({"steps": 2},))
    with pytest.raises(ValueError, match="TrainConfig.grad_accum must divide every stage's global "
                                         "batch, got 3 for stage 0"):
        plan_stages(staged_config("TrainConfig.grad_accum = 3"), 1)
    assert TrainConfig(steps=2, stages=[StageConfig(steps=2)]).stages == (StageConfig(steps=2),)


def test_stage_configs_parse():
    ramp = plan_stages(load_config(["configs/stages/tiny_ramp.gin"]), 1)
    assert [(s.seq_len, s.data.batch_size, s.tokens_per_step) for s in ramp] == [
        (512, 16, 8192), (2048, 4, 8192), (8192, 1, 8192)]
    assert all(s.config.retrieval_share == 1.0 for s in ramp)  # the needle experiment: retrieval rows only
    # Its control differs only in the context lengths: same steps, tokens per step, retrieval mix.
    (control,) = plan_stages(load_config(["configs/stages/tiny_512.gin"]), 1)
    assert control.seq_len == 512 and control.tokens_per_step == 8192
    assert control.config.steps == sum(s.config.steps for s in ramp)
    for s in ramp:
        assert s.config.retrieval_share == control.config.retrieval_share > 0
        assert s.config.retrieval_tasks == control.config.retrieval_tasks
        assert s.config.retrieval_answer_weight == control.config.retrieval_answer_weight
    k3 = plan_stages(load_config(["configs/stages/k3_1m.gin"]), 1)
    assert [s.seq_len for s in k3] == [8192, 65536, 262144, 1048576]
    shares = [s.config.long_doc_share for s in k3]  # the long-document share grows per stage
    assert shares == sorted(shares) and shares[-1] > shares[0]
    assert {s.tokens_per_step for s in k3} == {2 ** 26}
    assert k3[-1].config.eval_lengths[-1] == 2 ** 20


def test_position_round_trips_and_reads_pre_curriculum_checkpoints():
    position = Position(2, 40, Plateau(1.5, 1), {"next_index": 7})
    assert Position.from_json(position.to_json()) == position
    assert Position.from_json({"next_index": 7}) == Position(iterator={"next_index": 7})


def test_long_doc_share_mixes_single_document_windows():
    config = DataConfig(seq_len=256, batch_size=4)
    corpus = data_lib.load_corpus(config, "train")
    windows = data_lib.long_document_windows(corpus, 256)
    ends = np.append(corpus.doc_starts[1:], corpus.num_tokens)
    doc = np.searchsorted(corpus.doc_starts, windows, side="right") - 1
    assert len(windows) and np.all(windows + 256 < ends[doc])  # T + 1 tokens inside one document

    starts = data_lib.train_row_starts(config, corpus, long_doc_share=0.25)
    first = np.array([starts[i] for i in range(400)])
    is_window = np.isin(first, windows)
    assert is_window.sum() >= 100 and np.all(is_window[3::4])  # every 4th row is a window
    plain = np.delete(first, np.s_[3::4])
    np.testing.assert_array_equal(plain, [data_lib.train_row_starts(config, corpus)[i]
                                          for i in range(300)])  # the rest: the packed stream, in order

    batch = next(data_lib.make_train_iterator(config, long_doc_share=1.0))
    assert np.all(batch["segment_ids"] == 1) and np.all(batch["loss_mask"] == 1)
    with pytest.raises(ValueError, match="StageConfig.long_doc_share=0.5 needs train documents of "
                                         "at least seq_len"):
        data_lib.make_train_iterator(dataclasses.replace(config, seq_len=2 ** 22),
                                     long_doc_share=0.5)
