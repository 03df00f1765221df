"""KDA public API: decode step, tiling choice, gates, dtypes, backend dispatch and argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import (bounded_gate, chunk_kda, kda_diagonal_path, recurrent_kda, relative_rms_error,
                                softplus_gate)
from pallas_kernels.kda.testing import random_inputs

NAMES = ("q", "k", "v", "g", "beta")


def _inputs(**kw):
    shape = dict(batch=2, seq_len=15, heads=2, value_heads=4, key_dim=32, value_dim=32)
    return random_inputs(0, **{**shape, **kw})


def test_recurrent_steps_equal_reference():
    x = _inputs()
    ref_o, ref_state = chunk_kda(*(x[n] for n in NAMES), initial_state=x["initial_state"], output_final_state=True,
                                 backend="reference")
    state, outputs = x["initial_state"], []
    for t in range(x["q"].shape[1]):
        o, state = recurrent_kda(*(x[n][:, t] for n in NAMES), state)
        outputs.append(o)
    assert relative_rms_error(ref_o, jnp.stack(outputs, axis=1)) < 1e-6
    assert relative_rms_error(ref_state, state) < 1e-6


@pytest.mark.parametrize("g_min,chunk_size,path", [
    (-5.0, 64, ("dense", 16)),
    (-2.0, 64, ("dense", 32)),
    (-8.0, 64, ("dense", 8)),
    (-15.0, 64, ("pairwise", 16)),
    (None, 64, ("pairwise", 16)),
    (-1.0, 64, ("dense", 64)),
    (-1.0, 32, ("dense", 32)),  # R must divide the chunk
    (-5.0, 8, ("dense", 8)),
    (None, 8, ("pairwise", 8)),
])
def test_diagonal_path(g_min, chunk_size, path):
    assert kda_diagonal_path(g_min, chunk_size) == path


@pytest.mark.parametrize("g_min", [0.5, -25.0, 0.0, float("nan"), "-5"])
def test_bad_g_min_is_rejected_with_its_range(g_min):
    for call in (lambda: kda_diagonal_path(g_min, 64),
                 lambda: chunk_kda(*(_inputs()[n] for n in NAMES), g_min=g_min),
                 lambda: bounded_gate(jnp.zeros((4, 32)), jnp.zeros(4), jnp.zeros((4, 32)), g_min)):
        with pytest.raises(ValueError, match=r"g_min must be a number in \[-20, 0\), got"):
            call()


@pytest.mark.parametrize("chunk_size", [48, 4, 512, 64.0])
def test_bad_chunk_size_is_rejected(chunk_size):
    with pytest.raises(ValueError, match=r"chunk_size must be a power of two in \[8, 256\], got"):
        chunk_kda(*(_inputs()[n] for n in NAMES), chunk_size=chunk_size)


def test_shape_errors_name_the_argument():
    x = _inputs()
    q, k, v, g, beta = (x[n] for n in NAMES)
    grouping = r"value heads HV = v.shape\[2\] must be a multiple of q/k heads H = 2, got HV = 3"
    with pytest.raises(ValueError, match=grouping):
        chunk_kda(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match=r"chunk_kda: g must have shape \[B, T, HV, K\] = \(2, 15, 4, 32\)"):
        chunk_kda(q, k, v, g[..., :16], beta)
    with pytest.raises(ValueError, match=r"chunk_kda: k must have shape"):
        chunk_kda(q, k[:, :14], v, g, beta)
    with pytest.raises(ValueError, match=r"chunk_kda: initial_state must have shape \[B, HV, K, V\]"):
        chunk_kda(q, k, v, g, beta, initial_state=x["initial_state"][:, :2])
    with pytest.raises(ValueError, match=r"chunk_kda: segment_ids must have shape \[B, T\]"):
        chunk_kda(q, k, v, g, beta, segment_ids=jnp.zeros((2, 14), jnp.int32))
    with pytest.raises(ValueError, match=r"recurrent_kda: state must have shape \[B, HV, K, V\]"):
        recurrent_kda(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], x["initial_state"][..., :8])


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'reference', 'xla'.*got 'triton'"):
        chunk_kda(*(_inputs()[n] for n in NAMES), backend="triton")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="auto picks the kernels on accelerators")
def test_auto_is_xla_on_cpu():
    x = _inputs()
    auto, _ = chunk_kda(*(x[n] for n in NAMES), g_min=-5.0)
    xla, _ = chunk_kda(*(x[n] for n in NAMES), g_min=-5.0, backend="xla")
    np.testing.assert_array_equal(auto, xla)


def test_bf16_inputs_saturated_at_the_bound_stay_finite():
    x = _inputs(dtype=jnp.bfloat16)
    g = jnp.full(x["g"].shape, -5.0, jnp.float32)
    o, state = chunk_kda(x["q"], x["k"], x["v"], g, x["beta"], g_min=-5.0, output_final_state=True)
    assert o.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(state)).all()
    # The same bf16 values in fp32: the op computes in fp32, so only the output rounding differs.
    f32 = {n: x[n].astype(jnp.float32) for n in ("q", "k", "v", "beta")}
    o32, _ = chunk_kda(f32["q"], f32["k"], f32["v"], g, f32["beta"], g_min=-5.0)
    assert relative_rms_error(o32, o) < 1e-2


def test_gates():
    rng = np.random.default_rng(0)
    f = jnp.asarray(3 * rng.standard_normal((2, 5, 4, 8), np.float32))
    a_log = jnp.asarray(rng.standard_normal(4, np.float32))
    dt_bias = jnp.asarray(rng.standard_normal((4, 8), np.float32))
    bounded = bounded_gate(f.astype(jnp.bfloat16), a_log, dt_bias, -5.0)
    unbounded = softplus_gate(f, a_log, dt_bias)
    assert bounded.dtype == unbounded.dtype == jnp.float32 and bounded.shape == unbounded.shape == f.shape
    assert bool(jnp.all((bounded >= -5.0) & (bounded <= 0))) and bool(jnp.all(unbounded <= 0))
    x = np.exp(np.asarray(a_log))[:, None] * (np.asarray(f) + np.asarray(dt_bias))
    np.testing.assert_allclose(bounded_gate(f, a_log, dt_bias, -5.0), -5.0 / (1 + np.exp(-x)), rtol=1e-5)
    softplus = np.logaddexp(0, np.asarray(f) + np.asarray(dt_bias))
    np.testing.assert_allclose(unbounded, -np.exp(np.asarray(a_log))[:, None] * softplus, rtol=1e-5)


def test_relative_rms_error():
    assert relative_rms_error(np.ones(4), np.ones(4)) == 0.0
    assert relative_rms_error(np.full(4, 2.0), np.full(4, 2.2)) == pytest.approx(0.1)
    assert relative_rms_error(np.zeros(3), np.full(3, 0.5)) == pytest.approx(0.5)
