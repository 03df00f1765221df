"""Token-by-token KDA in fp32: the oracle every other backend is tested against (DESIGN 3.1 recurrence)."""

import jax
import jax.numpy as jnp

from pallas_kernels.kda.layout import document_starts, expand_heads

_HIGHEST = jax.lax.Precision.HIGHEST


def kda_step(state, q, k, v, g, beta):
    """One KDA token for every head. Also the decode step (recurrent_kda).

    state: [..., K, V] fp32; q (already scaled), k: [..., K]; v: [..., V]; g: [..., K] log decay; beta: [...].
    Returns (new state [..., K, V], o [..., V]), all fp32.
    """
    state = state * jnp.exp(g)[..., :, None]
    predicted = jnp.einsum("...k,...kv->...v", k, state, precision=_HIGHEST)
    correction = beta[..., None] * (v - predicted)
    state = state + k[..., :, None] * correction[..., None, :]
    o = jnp.einsum("...k,...kv->...v", q, state, precision=_HIGHEST)
    return state, o


def kda_reference(q, k, v, g, beta, initial_state, segment_ids, *, scale):
    """lax.scan over tokens in fp32; the state is zeroed wherever segment_ids changes (a new document starts).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]; initial_state: [B, HV, K, V] fp32;
    segment_ids: [B, T] int or None. Returns o [B, T, HV, V] fp32 and the final state [B, HV, K, V] fp32.
    """
    f32 = jnp.float32
    num_value_heads = v.shape[2]
    q = expand_heads(q.astype(f32), num_value_heads) * scale
    k = expand_heads(k.astype(f32), num_value_heads)
    if segment_ids is None:
        starts = jnp.zeros(q.shape[:2], bool)
    else:
        starts = document_starts(segment_ids)

    def token(state, xs):
        q_t, k_t, v_t, g_t, beta_t, start_t = xs
        state = jnp.where(start_t[:, None, None, None], 0.0, state)
        return kda_step(state, q_t, k_t, v_t, g_t, beta_t)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v.astype(f32), g.astype(f32), beta.astype(f32), starts)]
    state, o = jax.lax.scan(token, initial_state.astype(f32), time_major)
    return jnp.moveaxis(o, 0, 1), state
