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
