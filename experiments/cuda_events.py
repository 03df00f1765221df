"""CUDA-event timing of jitted JAX functions on a GPU, as torch.cuda.Event and triton's do_bench time PyTorch.

JAX has no public event API, so cuda_events.cc (built here on first use with the C++ compiler and the XLA FFI headers
that jaxlib ships) is an FFI custom call that records a CUDA event on the stream XLA runs it on. A jitted call of it
before and after the timed function brackets that function's device work in stream order:

  timer = CudaEvents()
  ms = timer.median_ms(jitted_fn, [args_a, args_b, args_c], repeats=30)

Each sample is one call between two events, samples are dispatched back to back with no synchronisation between
them (the host runs ahead, so the device never waits for it), and the elapsed times are read at the end.
"""

import ctypes
import functools
import hashlib
import os
import shutil
import statistics
import subprocess
import time

import numpy as np

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_events.cc")
TARGET = "hybridmoe_record_event"


def _cache_dir():
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "hybridmoe")


def build(out_dir=None):
    """Compiles cuda_events.cc into a shared library (cached by the source's and jaxlib's versions); returns its
    path. Raises RuntimeError naming the compiler and its output if none is found or the build fails."""
    import jax.ffi
    import jaxlib
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + jaxlib.__version__.encode()).hexdigest()[:16]
    out_dir = out_dir or _cache_dir()
    path = os.path.join(out_dir, f"cuda_events_{key}.so")
    if os.path.exists(path):
        return path
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("cuda_events: no C++ compiler (set CXX, or install c++/g++)")
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    cmd = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp, "-ldl"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"cuda_events: build failed ({' '.join(cmd)}):\n{result.stderr[-3000:]}")
    os.replace(tmp, path)  # atomic: a concurrent build never leaves a half-written library
    return path


class CudaEvents:
    """Records CUDA events on JAX's stream (see the module docstring). GPU only: raises RuntimeError elsewhere."""

    def __init__(self):
        import jax
        if jax.default_backend() != "gpu":
            raise RuntimeError(f"CudaEvents needs a CUDA GPU backend, got {jax.default_backend()!r}")
        self._lib = ctypes.cdll.LoadLibrary(build())
        self._lib.hm_elapsed_ms.restype = ctypes.c_float
        self._lib.hm_elapsed_ms.argtypes = (ctypes.c_int, ctypes.c_int)
        _register(self._lib)

    def record(self, slot):
        """Enqueues a record of event `slot` on the stream, after everything dispatched before it."""
        return _recorder(slot)()

    def elapsed_ms(self, start, end):
        """ms from event `start` to event `end` (waits for `end`)."""
        ms = self._lib.hm_elapsed_ms(start, end)
        if ms < 0:
            raise RuntimeError(f"cuda_events: no elapsed time between events {start} and {end} (code {ms:g})")
        return float(ms)

    def times_ms(self, fn, inputs, repeats, warmup=1):
        """Per-call event times (ms) of fn over `repeats` calls cycling through the argument tuples `inputs`."""
        import jax
        for args in inputs * warmup:  # compile, load and touch every input set
            jax.block_until_ready(fn(*args))
        for slot in range(2 * repeats):  # compile every recorder now: compiling one between two events would count
            self.record(slot)
        out = None
        for i in range(repeats):
            self.record(2 * i)
            out = fn(*inputs[i % len(inputs)])
            self.record(2 * i + 1)
        jax.block_until_ready(out)
        return [self.elapsed_ms(2 * i, 2 * i + 1) for i in range(repeats)]

    def median_ms(self, fn, inputs, repeats, warmup=1):
        return statistics.median(self.times_ms(fn, inputs, repeats, warmup))


@functools.cache
def _register(lib):
    import jax
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.HmRecordEvent), platform="CUDA")


@functools.cache
def _recorder(slot):
    import jax
    import jax.numpy as jnp
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True)
    return jax.jit(lambda: call(slot=np.int64(slot)))


def wall_median_ms(fn, inputs, repeats, calls_per_sample=4):
    """The fallback without a GPU event library: median ms per call over samples of `calls_per_sample` calls
    dispatched back to back on rotating input sets with one synchronisation at the end (the host-device round trip
    is paid once per sample, and counted)."""
    import jax
    for args in inputs:
        jax.block_until_ready(fn(*args))
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        for j in range(calls_per_sample):
            out = fn(*inputs[(i * calls_per_sample + j) % len(inputs)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / calls_per_sample)
    return statistics.median(times)
