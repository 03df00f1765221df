"""Helpers for KDA tests and benchmarks: the error metric and layer-like random inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda.gates import bounded_gate, softplus_gate


def relative_rms_error(ref, out):
    """RMS(ref - out) / RMS(ref), computed in float64; the plain RMS(out) when ref is all zeros."""
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    if ref.shape != out.shape:
        raise ValueError(f"relative_rms_error: shapes differ, ref {ref.shape} vs out {out.shape}")
    err = np.sqrt(np.mean((ref - out) ** 2))
    norm = np.sqrt(np.mean(ref ** 2))
    return float(err / norm) if norm > 0 else float(err)


@functools.partial(jax.jit, static_argnames=("gate", "g_min"))
def _gate(f, a_log, dt_bias, gate, g_min):
    if gate == "bounded":
        return bounded_gate(f, a_log, dt_bias, g_min)
    return softplus_gate(f, a_log, dt_bias)


def random_inputs(seed, *, batch, seq_len, heads, value_heads, key_dim, value_dim, gate="bounded", g_min=-5.0,
                  dtype=jnp.float32):
    """Inputs as the KDA layer makes them: L2-normalised q, k; sigmoid beta; g from a gate at its initialisation
    (a_log = 0, dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1]); a random fp32 initial state.

    Drawn with numpy, so new shapes cost no compilation. gate: "bounded" (uses g_min) or "softplus".
    Returns a dict with q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] fp32; beta: [B, T, HV];
    initial_state: [B, HV, K, V] fp32.
    """
    if gate not in ("bounded", "softplus"):
        raise ValueError(f"random_inputs: gate must be 'bounded' or 'softplus', got {gate!r}")
    rng = np.random.default_rng(seed)
    normal = functools.partial(rng.standard_normal, dtype=np.float32)
    qk_shape = (batch, seq_len, heads, key_dim)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (normal(qk_shape), normal(qk_shape)))
    v = normal((batch, seq_len, value_heads, value_dim))
    beta = 1 / (1 + np.exp(-normal((batch, seq_len, value_heads))))
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), (value_heads, key_dim))).astype(np.float32)
    dt_bias = dt + np.log(-np.expm1(-dt))  # softplus^-1
    f = normal((batch, seq_len, value_heads, key_dim))
    g = _gate(f, np.zeros(value_heads, np.float32), dt_bias, gate, g_min)
    state = 0.1 * normal((batch, value_heads, key_dim, value_dim))
    cast = functools.partial(jnp.asarray, dtype=dtype)
    return dict(q=cast(q), k=cast(k), v=cast(v), g=g, beta=cast(beta), initial_state=jnp.asarray(state))
