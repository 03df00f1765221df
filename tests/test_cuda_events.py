"""experiments/cuda_events: the event-recording custom call builds, loads and lowers for CUDA without a GPU (what
runs on the GPU is checked there by bench_kda --timer=both, which times every row both ways)."""

import ctypes

import jax
import pytest

from experiments import cuda_events


def test_the_event_library_builds_and_reports_unrecorded_events(tmp_path):
    path = cuda_events.build(str(tmp_path))
    assert cuda_events.build(str(tmp_path)) == path  # cached: the same source and jaxlib are not built twice
    lib = ctypes.cdll.LoadLibrary(path)
    lib.hm_elapsed_ms.restype = ctypes.c_float
    assert lib.hm_elapsed_ms(0, 1) == -1.0  # no event was recorded, so there is no elapsed time to report
    cuda_events._register(lib)
    text = cuda_events._recorder(7).trace().lower(lowering_platforms=("cuda",)).as_text()
    assert f"@{cuda_events.TARGET}" in text and "has_side_effect = true" in text and "slot = 7" in text


def test_the_timer_refuses_a_backend_without_cuda():
    assert jax.default_backend() == "cpu"
    with pytest.raises(RuntimeError, match="CUDA GPU backend, got 'cpu'"):
        cuda_events.CudaEvents()


def test_bench_kda_times_by_the_host_clock_without_a_gpu():
    from absl import flags
    from absl.testing import flagsaver

    from experiments import bench_kda
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    fn = jax.jit(lambda x: x * 2)
    inputs = [(jax.numpy.ones(8),)] * 3
    with flagsaver.flagsaver(timer="both"):
        times = bench_kda._median_ms(fn, inputs, repeats=3)
    assert set(times) == {"wall"} and times["wall"] > 0  # a CPU dry run still gets its rows, by the host clock
