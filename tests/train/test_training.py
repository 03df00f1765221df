"""Training system: exact resume, interruption, damaged checkpoints, non-finite guard, metrics, sweeps."""

import json
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe import load_config
from hybridmoe.train import loop
from hybridmoe.train.checkpoint import Checkpointer
from hybridmoe.train.metrics import JSONL_KEYS

MICRO = [
    "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2", "ModelConfig.dtype = 'float32'",
    "KDAConfig.num_heads = 2", "KDAConfig.head_dim = 16", "KDAConfig.chunk_size = 16",
    "MLAConfig.num_heads = 2", "MLAConfig.kv_lora_rank = 16", "MLAConfig.qk_nope_head_dim = 8",
    "MLAConfig.qk_rope_head_dim = 8", "MLAConfig.v_head_dim = 8",
    "MoEConfig.num_experts = 4", "MoEConfig.expert_width = 32",
    "DataConfig.seq_len = 64", "DataConfig.batch_size = 4",
    "TrainConfig.steps = 6", "TrainConfig.warmup_steps = 2", "TrainConfig.log_every = 1",
    "TrainConfig.eval_every = 3", "TrainConfig.eval_batches = 2", "TrainConfig.checkpoint_every = 3",
    "TrainConfig.peak_tflops = 1.0",
]


def micro_config(*extra):
    return load_config(["configs/tiny.gin"], MICRO + list(extra))


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_params(workdir, config):
    from hybridmoe.model import build_model
    from hybridmoe.train.checkpoint import abstract_like
    from hybridmoe.train.optimizer import make_optimizer
    from hybridmoe.train.step import init_train_state
    model = build_model(config.model)
    example = jnp.zeros((config.data.batch_size, config.data.seq_len), jnp.int32)
    opt = make_optimizer(config.train, jax.eval_shape(model.init, jax.random.key(0), example)["params"])
    state = init_train_state(model, opt, example, config.train.seed)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), 3)
    step, restored, _ = ckpt.restore_latest(abstract_like(state))
    ckpt.close()
    return step, restored


def test_resume_is_bitwise_exact(tmp_path):
    config = micro_config()
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    loop.train(config, straight, progress=False)
    first = loop.train(config, split, progress=False, stop_after=3)
    assert first.step == 3
    loop.train(config, split, progress=False)  # a fresh call resumes from the step-3 checkpoint
    losses = lambda w: [(r["step"], r["loss"]) for r in read_metrics(w) if r["split"] == "train"]
    assert losses(straight) == losses(split)
    step_a, a = final_params(straight, config)
    step_b, b = final_params(split, config)
    assert step_a == step_b == 6
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_metrics_files_have_documented_keys(tmp_path):
    workdir = str(tmp_path / "run")
    result = loop.train(micro_config(), workdir, progress=False)
    records = read_metrics(workdir)
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "validation"]
    assert len(train) == 6 and len(val) == 2
    for key in JSONL_KEYS:
        assert key in train[-1], key
    assert any(k.startswith("router/layer_0/") and k.endswith("max_vio") for k in train[-1])
    assert {"loss", "bits_per_byte"} <= set(val[-1])
    assert os.listdir(os.path.join(workdir, "tensorboard"))
    assert result.final_eval["bits_per_byte"] == val[-1]["bits_per_byte"]


def test_interruption_saves_and_resumes(tmp_path, monkeypatch):
    workdir = str(tmp_path / "run")
    config = micro_config()
    real_write = loop.metrics_lib.MetricsWriter.write

    def write_then_interrupt(self, step, record, split="train"):
        real_write(self, step, record, split)
        if split == "train" and step == 2:  # Ctrl-C arrives during step 2's bookkeeping
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(loop.metrics_lib.MetricsWriter, "write", write_then_interrupt)
    result = loop.train(config, workdir, progress=False)
    monkeypatch.undo()
    assert result.interrupted and result.step == 2
    assert Checkpointer(os.path.join(workdir, "checkpoints"), 3).all_steps() == [2]
    resumed = loop.train(config, workdir, progress=False)
    assert resumed.step == 6 and not resumed.interrupted


def test_damaged_latest_checkpoint_falls_back(tmp_path, caplog):
    workdir = str(tmp_path / "run")
    config = micro_config()
    loop.train(config, workdir, progress=False)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    assert sorted(int(s) for s in os.listdir(ckpt_dir) if s.isdigit()) == [3, 6]
    state_dir = os.path.join(ckpt_dir, "6", "state")
    shutil.rmtree(state_dir)
    os.makedirs(state_dir)
    with open(os.path.join(state_dir, "garbage"), "w") as f:
        f.write("not a checkpoint")
    step, _ = final_params(workdir, config)
    assert step == 3


def _poison_second_batch(real_make):
    """A train iterator whose second batch has a NaN loss mask: that step's loss is NaN."""

    def make(cfg, **kw):
        inner = real_make(cfg, **kw)

        class Poisoned:
            count = 0

            def __next__(self):
                batch = dict(next(inner))
                Poisoned.count += 1
                if Poisoned.count == 2:
                    batch["loss_mask"] = np.full_like(batch["loss_mask"], np.nan)
                return batch

            def get_state(self):
                return inner.get_state()

            def set_state(self, state):
                inner.set_state(state)

        return Poisoned()

    return make


def test_nonfinite_step_is_skipped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(loop.data_lib, "make_train_iterator",
                        _poison_second_batch(loop.data_lib.make_train_iterator))
    workdir = str(tmp_path / "run")
    loop.train(micro_config(), workdir, progress=False)
    train = [r for r in read_metrics(workdir) if r["split"] == "train"]
    assert [r["skipped_steps"] for r in train] == [0, 1, 1, 1, 1, 1]
    assert np.isnan(train[1]["loss"]) and np.isfinite(train[2]["loss"])
    step, params = final_params(workdir, micro_config())
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(params))

    with pytest.raises(loop.NonFiniteError, match="step 2"):
        loop.train(micro_config("TrainConfig.on_nonfinite = 'stop'"),
                   str(tmp_path / "stop"), progress=False)
