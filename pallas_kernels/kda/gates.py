"""KDA forget gates: per-step, per-channel log decays g <= 0 (DESIGN 3.1, "Gates")."""

import numbers

import jax
import jax.numpy as jnp

# The bounds a gate may promise. Below about -12.6 even 8-row dense blocks would overflow and the pairwise diagonal
# runs (see tiling.kda_diagonal_path).
G_MIN_RANGE = (-20.0, 0.0)


def check_g_min(g_min, where="g_min"):
    """Raises ValueError unless g_min is a number in [-20, 0). `where` names the argument in the message."""
    low, high = G_MIN_RANGE
    if isinstance(g_min, bool) or not isinstance(g_min, numbers.Real) or not low <= g_min < high:
        raise ValueError(f"{where} must be a number in [{low:g}, {high:g}), got {g_min!r}")


def bounded_gate(f, a_log, dt_bias, g_min):
    """Bounded decay g = g_min * sigmoid(exp(a_log[h]) * (f + dt_bias[h, d])), so g lies in [g_min, 0].

    f: [..., HV, K]; a_log: [HV]; dt_bias: [HV, K]; g_min: float in [-20, 0). Returns g: [..., HV, K] fp32.
    """
    check_g_min(g_min, "bounded_gate: g_min")
    f32 = jnp.float32
    rate = jnp.exp(a_log.astype(f32))[:, None]
    return g_min * jax.nn.sigmoid(rate * (f.astype(f32) + dt_bias.astype(f32)))


def softplus_gate(f, a_log, dt_bias):
    """Unbounded (original KDA) decay g = -exp(a_log[h]) * softplus(f + dt_bias[h, d]).

    f: [..., HV, K]; a_log: [HV]; dt_bias: [HV, K]. Returns g: [..., HV, K] fp32, any value <= 0.
    """
    f32 = jnp.float32
    rate = jnp.exp(a_log.astype(f32))[:, None]
    return -rate * jax.nn.softplus(f.astype(f32) + dt_bias.astype(f32))
