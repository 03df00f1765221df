"""MetricsWriter: JSONL always, TensorBoard when tensorboardX is importable."""

import builtins
import json
import os

import pytest

from hybridmoe.train.metrics import MetricsWriter


def test_writes_jsonl_and_tensorboard(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.write(3, {"loss": 1.5, "router": {"max_vio": 0.25}})
    writer.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 3, "split": "train", "loss": 1.5, "router/max_vio": 0.25}]
    assert os.listdir(tmp_path / "tensorboard")


def test_without_tensorboardx_it_warns_and_keeps_the_jsonl(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_tensorboardx(name, *args, **kwargs):
        if name.startswith("tensorboardX"):
            raise ImportError("No module named 'tensorboardX'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboardx)
    with pytest.warns(UserWarning, match="tensorboardX is not installed"):
        writer = MetricsWriter(str(tmp_path))
    writer.write(1, {"loss": 2.0}, split="eval")
    writer.close()
    assert json.loads(open(tmp_path / "metrics.jsonl").read()) == {"step": 1, "split": "eval", "loss": 2.0}
    assert not (tmp_path / "tensorboard").exists()
