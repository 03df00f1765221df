"""bench_kda names its result files after the card that measured them."""

import pytest

from experiments.bench_kda import result_name


@pytest.mark.parametrize("kind, name", [("NVIDIA H200", "kda_h200"), ("NVIDIA H100 80GB HBM3", "kda_h100"),
                                        ("NVIDIA GH200 480GB", "kda_gh200"), ("cpu", "kda_cpu")])
def test_result_files_are_named_after_the_card(kind, name):
    assert result_name(kind) == name


def test_the_chart_has_one_bar_per_row_and_pass(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments import bench_kda
    rows = [dict(variant=v, tuning=t, B=b, T=t_len, H=16, D=128, fwd_ms=1.0 + i, fwdbwd_ms=3.0 + i)
            for i, (v, t) in enumerate([("fla_bounded", "-"), ("pallas_bounded", "base")])
            for b, t_len in [(1, 8192), (4, 8192)]]
    rows.append(dict(variant="pallas_bounded", tuning="fused_outputs=1", B=1, T=8192, H=16, D=128,
                     fwd_ms=0.5, fwdbwd_ms=2.5))  # a tuning run at one shape only
    saved = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: saved.update(fig=fig, path=path))
    bench_kda.write_plot(rows, str(tmp_path / "kda.png"), "title")
    heights = [[p.get_height() for p in ax.patches] for ax in saved["fig"].axes]
    floors = {b: bench_kda.floor_ms(b, 8192, 16, 128) for b in (1, 4)}
    assert len(heights[0]) == len(heights[1]) == len(rows)
    assert sorted(heights[0]) == pytest.approx(sorted(r["fwd_ms"] / floors[r["B"]] for r in rows))
    assert sorted(heights[1]) == pytest.approx(sorted(r["fwdbwd_ms"] / (3.2 * floors[r["B"]]) for r in rows))
