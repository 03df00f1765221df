"""Sweep runner: grid parsing, one run per point, restart skips finished points, table and plot."""

import csv
import os

import pytest

from experiments import sweep
from tests.train.test_training import MICRO


def test_parse_and_grid():
    assert sweep.parse_sweep("KDAConfig.g_min=[-3,-5.5]") == ("KDAConfig.g_min", [-3, -5.5])
    points = sweep.grid(["A.x=[1,2]", "B.y=['u','v']"])
    assert points == [{"A.x": 1, "B.y": "u"}, {"A.x": 1, "B.y": "v"},
                      {"A.x": 2, "B.y": "u"}, {"A.x": 2, "B.y": "v"}]
    assert sweep.point_name({"A.x": 1, "B.y": "u"}) == "x=1,y=u"
    with pytest.raises(ValueError, match="--sweep must look like"):
        sweep.parse_sweep("KDAConfig.g_min=-3")
    assert sweep.parse_point('AttnResConfig.mode="block"; AttnResConfig.block_size=4') == {
        "AttnResConfig.mode": "block", "AttnResConfig.block_size": 4}
    assert sweep.binding_string("RouterConfig.name", "quantile") == 'RouterConfig.name = "quantile"'
    assert sweep.binding_string("KDAConfig.g_min", -3.5) == "KDAConfig.g_min = -3.5"
    with pytest.raises(ValueError, match="--point parts must look like"):
        sweep.parse_point("mode block")


def test_sweep_runs_points_skips_finished_and_writes_outputs(tmp_path, monkeypatch):
    root = str(tmp_path / "sweep")
    rows = sweep.run_sweep(["configs/tiny.gin"], ["DataConfig.seed=[0,1]"], root, MICRO)
    assert [r["point"] for r in rows] == ["seed=0", "seed=1"]
    with open(os.path.join(root, "results.csv")) as f:
        table = list(csv.DictReader(f))
    assert [r["point"] for r in table] == ["seed=0", "seed=1"]
    assert all(float(r["val_loss"]) > 0 for r in table)
    assert all(0 <= float(r["max_vio"]) and 0 < float(r["load_entropy"]) <= 1 for r in table)
    assert table[0]["val_loss"] != table[1]["val_loss"]  # different data order, different run
    assert os.path.getsize(os.path.join(root, "curves.png")) > 1000
    assert "| seed=0 |" in open(os.path.join(root, "results.md")).read()

    # Restart: both points are finished, so no training happens and the table is the same.
    def no_training(*args, **kwargs):
        raise AssertionError("a finished point was trained again")

    monkeypatch.setattr(sweep, "train", no_training)
    again = sweep.run_sweep(["configs/tiny.gin"], ["DataConfig.seed=[0,1]"], root, MICRO)
    assert again == rows
