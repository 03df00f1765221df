"""bench_kda's fla child: one that fails (here: no fla, or no reference file) or outlives --fla_timeout costs only its
own rows."""

from absl import flags
from absl.testing import flagsaver

from experiments import bench_kda


def test_a_failing_fla_child_returns_no_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    jobs = dict(reference=str(tmp_path / "missing.npz"), runs=[dict(shape=[1, 64, 1, 16], variant="fla_bounded")])
    with flagsaver.flagsaver(fla_timeout=120):
        child = bench_kda.start_fla_child(jobs)
        result = bench_kda.finish_fla_child(child)
    assert child["process"].returncode != 0
    assert result == dict(rows=[], fla="not run", torch="-")


def test_an_fla_child_past_its_limit_is_stopped(tmp_path, monkeypatch):
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nsleep 60\n")
    hang.chmod(0o755)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(bench_kda.sys, "executable", str(hang))  # the child command then just hangs
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    with flagsaver.flagsaver(fla_timeout=1):
        child = bench_kda.start_fla_child(dict(reference="-", runs=[]))
        result = bench_kda.finish_fla_child(child)
    assert child["process"].returncode is not None and child["process"].returncode < 0  # killed
    assert result["rows"] == []


def test_bounded_rows_skip_tunings_only_the_unbounded_gate_reads():
    from pallas_kernels.kda.pallas_fwd import Tuning
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    # diagonal_kernel is on by default: turning it off changes the unbounded gate's kernels alone.
    names = ["base", "diagonal_kernel=0,diagonal_warps=4", "mosaic_output=0", "diagonal_kernel=0,intra_warps=8"]
    tunings = [(name, Tuning.from_string(name)) for name in names]
    with flagsaver.flagsaver(tuned=["pallas_bounded", "pallas_unbounded"]):
        assert [n for n, _ in bench_kda.row_tunings("pallas_unbounded", tunings)] == names
        assert [n for n, _ in bench_kda.row_tunings("pallas_bounded", tunings)] == [
            "base", "mosaic_output=0", "diagonal_kernel=0,intra_warps=8"]
    with flagsaver.flagsaver(tuned=["pallas_unbounded"]):
        assert [n for n, _ in bench_kda.row_tunings("pallas_bounded", tunings)] == ["base"]
    assert bench_kda.row_tunings("fla_bounded", tunings) == [("-", None)]
