import numpy as np
import pytest

from hybridmoe.analysis import router_summary


def _record(step, loads, split="train"):
    rec = {"step": step, "split": split}
    for i, load in enumerate(loads):
        load = np.asarray(load, float)
        rec[f"router/layer_{i}/load"] = load.tolist()
        rec[f"router/layer_{i}/max_vio"] = float(load.max() * len(load) - 1)
        rec[f"router/layer_{i}/max_vio_window"] = 0.0
        rec[f"router/layer_{i}/dropped_fraction"] = 0.1 * i
    return rec


def test_summary_averages_the_last_steps_over_layers():
    skewed, uniform = [0.5, 0.25, 0.25, 0.0], [0.25] * 4
    records = [_record(s, [skewed, skewed]) for s in range(5)]
    records += [_record(s, [uniform, skewed]) for s in range(5, 7)]
    records.insert(3, {"step": 3, "split": "validation", "loss": 1.0})
    out = router_summary(records, last=2)
    assert out["steps"] == 2 and out["layers"] == 2 and out["experts"] == 4
    assert out["max_vio"] == pytest.approx((0.0 + 1.0) / 2)
    assert out["max_load_x_uniform"] == pytest.approx((1.0 + 2.0) / 2)
    assert out["min_load_x_uniform"] == pytest.approx((1.0 + 0.0) / 2)
    assert out["dropped_fraction"] == pytest.approx(0.05)


def test_summary_needs_router_statistics():
    with pytest.raises(ValueError, match="no router/layer_i"):
        router_summary([{"split": "train", "loss": 1.0}])
    with pytest.raises(ValueError, match="no training records"):
        router_summary([{"split": "validation", "loss": 1.0}])
