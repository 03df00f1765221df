"""Forward KDA kernels, the inter-chunk state scan (sequential over chunks): S <- D S + kd^T (u - w S) per (batch,
value head, value tile), the fp32 state carried in registers, and o from the states (in a kernel parallel over
chunks, Tuning.separate_output) or inside the scan. Arrays as pallas_fwd.intra_forward returns them.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda import mosaic_scan
from pallas_kernels.kda import pallas_blocks as blk
from pallas_kernels.kda.pallas_fwd import (compiler_params, intra_precision, operand_cast, scan_load, scan_params,
                                           with_precision)

_F32 = jnp.float32


def saved_state_dtype(tuning, store_dtype):
    """Storage of the per-chunk states (forward) and state gradients (backward) kept for the backward: the
    intermediates' dtype when the scans multiply in it (Tuning.scan_low_precision), since every product then sees the
    state rounded to it anyway; fp32 otherwise. The carried state itself is always fp32."""
    return store_dtype if tuning.scan_low_precision else _F32


def sequence_specs(num_chunks, key_dim, tile):
    """Specs for the scans, grid (B, HV, V / tile): a whole sequence of [BN, HV, C, D] / [BN, HV, D] / [BN, C, HV, V]
    arrays per program, indexed by chunk inside the kernel."""
    keys = lambda chunk: pl.BlockSpec((num_chunks, None, chunk, key_dim), lambda b, h, t: (b, h, 0, 0))  # noqa: E731
    values = lambda chunk: pl.BlockSpec((num_chunks, None, chunk, tile), lambda b, h, t: (b, h, 0, t))  # noqa: E731
    vector = pl.BlockSpec((num_chunks, None, key_dim), lambda b, h, t: (b, h, 0))
    states = pl.BlockSpec((num_chunks, None, key_dim, tile), lambda b, h, t: (b, h, 0, t))
    time_major = lambda chunk: pl.BlockSpec((num_chunks, chunk, None, tile), lambda b, h, t: (b, 0, h, t))  # noqa
    state = pl.BlockSpec((None, None, key_dim, tile), lambda b, h, t: (b, h, 0, t))
    return keys, values, vector, states, time_major, state


@with_precision
def _scan_kernel(w_ref, qp_ref, kd_ref, u_ref, ol_ref, d_ref, s_init_ref, o_ref, s_out_ref, *saved_refs, low):
    """One (batch, value head, value tile): S <- D S + kd^T (u - w S), o = ol + qp S, chunk by chunk. saved_refs:
    (every chunk's incoming state, v_new) for the backward, or none."""
    cast, operand = operand_cast(low), scan_load(low)

    def step(n, state):  # state: [K, Vt] fp32, the chunk's incoming state
        v_new = u_ref[n].astype(_F32) - blk.mm(operand(w_ref, n), cast(state, w_ref))
        if saved_refs:
            saved_refs[0][n], saved_refs[1][n] = state.astype(saved_refs[0].dtype), v_new.astype(saved_refs[1].dtype)
        o_ref[n] = (ol_ref[n].astype(_F32) + blk.mm(operand(qp_ref, n), cast(state, qp_ref))).astype(o_ref.dtype)
        return d_ref[n][:, None] * state + blk.mm_tn(operand(kd_ref, n), cast(v_new, kd_ref))

    s_out_ref[...] = lax.fori_loop(0, d_ref.shape[0], step, s_init_ref[...])


@with_precision
def _states_kernel(w_ref, kd_ref, u_ref, d_ref, s_init_ref, s_out_ref, chunk_state_ref, v_new_ref, *, low):
    """One (batch, value head, value tile): S <- D S + kd^T (u - w S), storing every chunk's incoming state and
    v_new."""
    cast, operand = operand_cast(low), scan_load(low)

    def step(n, state):
        chunk_state_ref[n] = state.astype(chunk_state_ref.dtype)
        v_new = u_ref[n].astype(_F32) - blk.mm(operand(w_ref, n), cast(state, w_ref))
        v_new_ref[n] = v_new.astype(v_new_ref.dtype)
        return d_ref[n][:, None] * state + blk.mm_tn(operand(kd_ref, n), cast(v_new, kd_ref))

    s_out_ref[...] = lax.fori_loop(0, d_ref.shape[0], step, s_init_ref[...])


@with_precision
def _states_kernel_transposed(w_ref, kd_ref, u_ref, d_ref, s_init_ref, s_out_ref, chunk_state_ref, v_new_ref, *, low):
    """_states_kernel with the state carried transposed, S^T [Vt, K]: v_new^T = u^T - S^T w^T and
    S^T <- S^T D + v_new^T kd, so that the carried operands (S^T, v_new^T) are the products' left operands, which a
    warpgroup MMA may read from registers, and the stored tiles (w, kd) the right ones, read where they were loaded."""
    cast, operand = operand_cast(low), scan_load(low)

    def step(n, state_t):
        chunk_state_ref[n] = state_t.T.astype(chunk_state_ref.dtype)
        v_new_t = u_ref[n].astype(_F32).T - blk.mm_nt(cast(state_t, w_ref), operand(w_ref, n))
        v_new_ref[n] = v_new_t.T.astype(v_new_ref.dtype)
        return d_ref[n][None, :] * state_t + blk.mm(cast(v_new_t, kd_ref), operand(kd_ref, n))

    s_out_ref[...] = lax.fori_loop(0, d_ref.shape[0], step, s_init_ref[...].T).T


@with_precision
def _output_kernel(qp_ref, ol_ref, state_ref, o_ref, *, low):
    """One (chunk, value head, value tile): o = ol + qp S."""
    qp = qp_ref[...] if low else qp_ref[...].astype(_F32)
    state = state_ref[...].astype(qp.dtype)
    o_ref[...] = (ol_ref[...].astype(_F32) + blk.mm(qp, state)).astype(o_ref.dtype)


def _states_scan(w, kd, u, d, initial_state, *, tuning, interpret, precision):
    """The states alone: (final state, every chunk's incoming state, v_new)."""
    chunks, value_heads, chunk, key_dim = w.shape
    value_dim = u.shape[-1]
    batch = initial_state.shape[0]
    tile = min(tuning.state_tile, value_dim)
    if mosaic_scan.use(tuning, w, kd, u, tile=tile):
        return mosaic_scan.states_scan(w, kd, u, d, initial_state, tile=tile, interpret=interpret)
    keys, values, vector, states, _, state = sequence_specs(chunks // batch, key_dim, tile)
    return pl.pallas_call(
        functools.partial(_states_kernel_transposed if tuning.scan_transposed else _states_kernel, precision=precision,
                          low=tuning.scan_low_precision),
        grid=(batch, value_heads, value_dim // tile),
        in_specs=[keys(chunk)] * 2 + [values(chunk), vector, state],
        out_specs=[state, states, values(chunk)],
        out_shape=[jax.ShapeDtypeStruct(initial_state.shape, _F32),
                   jax.ShapeDtypeStruct((chunks, value_heads, key_dim, value_dim), saved_state_dtype(tuning, u.dtype)),
                   jax.ShapeDtypeStruct(u.shape, u.dtype)],
        compiler_params=scan_params(tuning, u.dtype),
        interpret=interpret,
        name="kda_states_fwd",
    )(w, kd, u, d, initial_state)


@with_precision
def _scores_output_kernel(q_ref, g_ref, doc_ref, prev_ref, aqk_ref, v_new_ref, state_ref, o_ref, *, scale, low):
    """One (chunk, value head): o = (Q e^Gamma on the incoming document's rows) S + Aqk v_new."""
    reads = (doc_ref[...] == blk.element(prev_ref[...], 0))[:, None]
    gam = jnp.cumsum(g_ref[...].astype(_F32), axis=0)
    qd = jnp.where(reads, q_ref[...].astype(_F32) * scale * jnp.exp(gam), 0.0)
    _write_o_from_scores(qd, aqk_ref, v_new_ref, state_ref, o_ref, low=low)


@with_precision
def _gated_output_kernel(qg_ref, aqk_ref, v_new_ref, state_ref, o_ref, *, low):
    """_scores_output_kernel from the scores kernel's qg = Q e^Gamma (Tuning.gated_inputs): o = qg S + Aqk v_new."""
    _write_o_from_scores(qg_ref[...], aqk_ref, v_new_ref, state_ref, o_ref, low=low)


def _write_o_from_scores(qd, aqk_ref, v_new_ref, state_ref, o_ref, *, low):
    """o = qd S + Aqk v_new, qd = Q e^Gamma on the incoming document's rows (any dtype; low: rounded to the state's)."""
    state = state_ref[...]
    inter = blk.mm(qd.astype(state.dtype), state) if low else blk.mm(qd.astype(_F32), state.astype(_F32))
    o_ref[...] = (inter + blk.mm(aqk_ref[...].astype(_F32), v_new_ref[...].astype(_F32))).astype(o_ref.dtype)


def scores_output_scan(w, kd, u, d, aqk, q, g, doc, doc_prev, initial_state, *, scale, out_dtype, tuning, interpret,
                       precision, qg=None):
    """The inference forward's second half (Tuning.output_from_scores): the states scanned alone, then o from the
    stored states, v_new and the chunk's Aqk in a kernel parallel over chunks (from qg instead of q and g where the
    scores kernel wrote it, Tuning.gated_inputs). Returns (o, final state)."""
    _, value_heads, chunk, key_dim = w.shape
    value_dim = u.shape[-1]
    group = value_heads // q.shape[2]
    tile = min(tuning.state_tile, value_dim)
    programs = initial_state.shape[0] * value_heads * (value_dim // tile)
    fused = tuning.mosaic_output and programs >= tuning.mosaic_output_programs
    if qg is not None and fused and mosaic_scan.use(tuning, w, kd, qg, u, tile=tile):
        return mosaic_scan.states_output_scan(w, kd, u, d, qg, aqk, initial_state, out_dtype=out_dtype, tile=tile,
                                              interpret=interpret)
    if tuning.scan_lookahead and mosaic_scan.use(tuning, w, kd, u, tile=tile):
        final, chunk_states, v_new = mosaic_scan.states_scan_lookahead(w, kd, u, d, initial_state, tile=tile,
                                                                       interpret=interpret)
    else:
        final, chunk_states, v_new = _states_scan(w, kd, u, d, initial_state, tuning=tuning, interpret=interpret,
                                                  precision=precision)
    if qg is not None:
        tiles = [pl.BlockSpec((None, None, chunk, dim), lambda n, h: (n, h, 0, 0))
                 for dim in (key_dim, chunk, value_dim)]
        state_spec = pl.BlockSpec((None, None, key_dim, value_dim), lambda n, h: (n, h, 0, 0))
        kernel = functools.partial(_gated_output_kernel, low=tuning.scan_low_precision,
                                   precision=intra_precision(tuning, precision, q.dtype))
        o = _per_chunk_output(kernel, tiles + [state_spec], (qg, aqk, v_new, chunk_states), shape=u.shape,
                              out_dtype=out_dtype, tuning=tuning, interpret=interpret, name="kda_scores_output_fwd")
        return o, final
    kernel = functools.partial(_scores_output_kernel, scale=scale, low=tuning.scan_low_precision,
                               precision=intra_precision(tuning, precision, q.dtype))
    in_specs = [pl.BlockSpec((None, chunk, None, key_dim), lambda n, h: (n, 0, h // group, 0)),
                pl.BlockSpec((None, chunk, None, key_dim), lambda n, h: (n, 0, h, 0)),
                pl.BlockSpec((None, chunk), lambda n, h: (n, 0)),
                pl.BlockSpec((None, chunk), lambda n, h: (n, 0)),
                pl.BlockSpec((None, None, chunk, chunk), lambda n, h: (n, h, 0, 0)),
                pl.BlockSpec((None, None, chunk, value_dim), lambda n, h: (n, h, 0, 0)),
                pl.BlockSpec((None, None, key_dim, value_dim), lambda n, h: (n, h, 0, 0))]
    o = _per_chunk_output(kernel, in_specs, (q, g, doc, doc_prev, aqk, v_new, chunk_states), shape=u.shape,
                          out_dtype=out_dtype, tuning=tuning, interpret=interpret, name="kda_scores_output_fwd")
    return o, final


def _per_chunk_output(kernel, in_specs, args, *, shape, out_dtype, tuning, interpret, name):
    """o [BN, C, HV, V] from a kernel over (chunk, value head); shape: [BN, HV, C, V] of u."""
    chunks, value_heads, chunk, value_dim = shape
    return pl.pallas_call(
        kernel,
        grid=(chunks, value_heads),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, chunk, None, value_dim), lambda n, h: (n, 0, h, 0)),
        out_shape=jax.ShapeDtypeStruct((chunks, chunk, value_heads, value_dim), out_dtype),
        compiler_params=compiler_params(tuning.state_warps),
        interpret=interpret,
        name=name,
    )(*args)


def _scan_then_output(w, qp, kd, u, ol, d, initial_state, *, out_dtype, tuning, interpret, precision, save_states):
    chunk, key_dim = w.shape[2:]
    value_dim = u.shape[-1]
    final, chunk_states, v_new = _states_scan(w, kd, u, d, initial_state, tuning=tuning, interpret=interpret,
                                              precision=precision)
    in_specs = [pl.BlockSpec((None, None, chunk, key_dim), lambda n, h: (n, h, 0, 0)),
                pl.BlockSpec((None, None, chunk, value_dim), lambda n, h: (n, h, 0, 0)),
                pl.BlockSpec((None, None, key_dim, value_dim), lambda n, h: (n, h, 0, 0))]
    o = _per_chunk_output(functools.partial(_output_kernel, precision=precision, low=tuning.scan_low_precision),
                          in_specs, (qp, ol, chunk_states), shape=u.shape, out_dtype=out_dtype, tuning=tuning,
                          interpret=interpret, name="kda_output_fwd")
    return (o, final, chunk_states, v_new) if save_states else (o, final)


def state_scan(w, qp, kd, u, ol, d, initial_state, *, out_dtype, tuning, interpret, precision, save_states):
    """Inter-chunk recurrence. Arrays as intra_forward returns them; initial_state: [B, HV, K, V] fp32.

    Returns o [BN, C, HV, V] in out_dtype, the final state [B, HV, K, V] and, if save_states, the backward's
    residuals: every chunk's incoming state [BN, HV, K, V] (saved_state_dtype) and v_new = u - w S [BN, HV, C, V]
    in u's dtype.
    """
    if tuning.separate_output:
        return _scan_then_output(w, qp, kd, u, ol, d, initial_state, out_dtype=out_dtype, tuning=tuning,
                                 interpret=interpret, precision=precision, save_states=save_states)
    chunks, value_heads, chunk, key_dim = w.shape
    value_dim = u.shape[-1]
    batch = initial_state.shape[0]
    tile = min(tuning.state_tile, value_dim)
    keys, values, vector, states, time_major, state = sequence_specs(chunks // batch, key_dim, tile)
    out_shape = [jax.ShapeDtypeStruct((chunks, chunk, value_heads, value_dim), out_dtype),
                 jax.ShapeDtypeStruct(initial_state.shape, _F32)]
    out_specs = [time_major(chunk), state]
    if save_states:
        out_shape += [jax.ShapeDtypeStruct((chunks, value_heads, key_dim, value_dim),
                                           saved_state_dtype(tuning, u.dtype)),
                      jax.ShapeDtypeStruct(u.shape, u.dtype)]
        out_specs += [states, values(chunk)]
    return pl.pallas_call(
        functools.partial(_scan_kernel, precision=precision, low=tuning.scan_low_precision),
        grid=(batch, value_heads, value_dim // tile),
        in_specs=[keys(chunk)] * 3 + [values(chunk)] * 2 + [vector, state],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=scan_params(tuning, u.dtype),
        interpret=interpret,
        name="kda_state_fwd",
    )(w, qp, kd, u, ol, d, initial_state)
