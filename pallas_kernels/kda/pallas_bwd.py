"""Backward KDA kernels: a reverse scan over chunks for the state gradient (sequential), then per-chunk gradients
(parallel over chunks) that recompute the chunk's forward quantities instead of storing them.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda import mosaic_scan
from pallas_kernels.kda import pallas_blocks as blk
from pallas_kernels.kda.pallas_blocks import ROWS, cumsum_rows, mm, mm_tn, score_products
from pallas_kernels.kda.pallas_chunk import backward_inputs, backward_scores, chunk_gates, k_base, mask_scores
from pallas_kernels.kda.pallas_fwd import (chunk_cumsum, chunk_tile, compiler_params, diagonal_call, diagonal_columns,
                                           input_bwd_rows, input_specs, intra_precision, operand_cast, ref_chunk,
                                           scan_load, scan_params, score_dtype, with_precision)
from pallas_kernels.kda.pallas_scan import saved_state_dtype, sequence_specs

_F32 = jnp.float32


@with_precision
def _state_grad_kernel(w_ref, qp_ref, kd_ref, d_ref, do_ref, ds_final_ref, ds_chunk_ref, dv_new_ref, ds_init_ref, *,
                       low):
    """One (batch, value head, value tile), last chunk first. dS is the gradient of the chunk's outgoing state."""
    num_chunks = d_ref.shape[0]
    cast, operand = operand_cast(low), scan_load(low)

    def step(i, ds):  # ds: [K, Vt] fp32
        n = num_chunks - 1 - i
        ds_chunk_ref[n] = ds.astype(ds_chunk_ref.dtype)
        dv_new = blk.mm(operand(kd_ref, n), cast(ds, kd_ref))
        dv_new_ref[n] = dv_new
        do = do_ref[n] if low else do_ref[n].astype(_F32)
        return (d_ref[n][:, None] * ds + blk.mm_tn(operand(qp_ref, n), do.astype(qp_ref.dtype) if low else do)
                - blk.mm_tn(operand(w_ref, n), cast(dv_new, w_ref)))

    ds_init_ref[...] = lax.fori_loop(0, num_chunks, step, ds_final_ref[...])


@with_precision
def _state_grad_kernel_transposed(w_ref, qp_ref, kd_ref, d_ref, do_ref, ds_final_ref, ds_chunk_ref, dv_new_ref,
                                  ds_init_ref, *, low):
    """_state_grad_kernel with dS carried transposed, dS^T [Vt, K] (Tuning.scan_transposed): dV_new^T = dS^T kd^T,
    dS_in^T = dS^T D + dO^T qp - dV_new^T w, the carried operands on the left of every product."""
    num_chunks = d_ref.shape[0]
    cast, operand = operand_cast(low), scan_load(low)

    def step(i, ds_t):  # ds_t: [Vt, K] fp32
        n = num_chunks - 1 - i
        ds_chunk_ref[n] = ds_t.T.astype(ds_chunk_ref.dtype)
        dv_new_t = blk.mm_nt(cast(ds_t, kd_ref), operand(kd_ref, n))
        dv_new_ref[n] = dv_new_t.T
        do_t = (do_ref[n] if low else do_ref[n].astype(_F32)).T
        return (d_ref[n][None, :] * ds_t + blk.mm(do_t.astype(qp_ref.dtype) if low else do_t, operand(qp_ref, n))
                - blk.mm(cast(dv_new_t, w_ref), operand(w_ref, n)))

    ds_init_ref[...] = lax.fori_loop(0, num_chunks, step, ds_final_ref[...].T).T


def state_grad(w, qp, kd, d, do, ds_final, *, tuning, interpret, precision):
    """Reverse recurrence dS_in = D dS_out + qp^T dO - w^T (kd dS_out).

    w, qp, kd: [BN, HV, C, K]; d: [BN, HV, K]; do: [BN, C, HV, V]; ds_final: [B, HV, K, V] fp32.
    Returns dS_out of every chunk [BN, HV, K, V] (saved_state_dtype), dV_new = kd dS_out [BN, HV, C, V] and dS of
    the initial state.
    """
    chunks, value_heads, chunk, key_dim = w.shape
    batch, _, _, value_dim = ds_final.shape
    tile = min(tuning.state_grad_tile or tuning.state_tile, value_dim)
    if mosaic_scan.use(tuning, w, qp, kd, do, tile=tile):
        return mosaic_scan.state_grad_scan(w, qp, kd, d, do, ds_final, tile=tile, interpret=interpret)
    keys, values, vector, states, time_major, state = sequence_specs(chunks // batch, key_dim, tile)
    return pl.pallas_call(
        functools.partial(_state_grad_kernel_transposed if tuning.scan_transposed else _state_grad_kernel,
                          precision=precision, low=tuning.scan_low_precision),
        grid=(batch, value_heads, value_dim // tile),
        in_specs=[keys(chunk)] * 3 + [vector, time_major(chunk), state],
        out_specs=[states, values(chunk), state],
        out_shape=[jax.ShapeDtypeStruct((chunks, value_heads, key_dim, value_dim),
                                        saved_state_dtype(tuning, w.dtype)),
                   jax.ShapeDtypeStruct((chunks, value_heads, chunk, value_dim), _F32),
                   jax.ShapeDtypeStruct(ds_final.shape, _F32)],
        compiler_params=scan_params(tuning, w.dtype),
        interpret=interpret,
        name="kda_state_bwd",
    )(w, qp, kd, d, do, ds_final)


@with_precision
def _state_side_kernel(s0_ref, ds_ref, v_new_ref, do_ref, dv_new_ref, dqp_ref, dw_ref, dkd_ref, dd_ref):
    """Gradients of one chunk's qp, w, kd and D on a tile of key channels; all contract over the value width:
    dqp = dO S0^T, dw = -dV_new S0^T, dkd = V_new dS^T, dD = rowsum(S0 * dS). Stored in 16 bits (saved_state_dtype),
    S0 and dS multiply the 16-bit dO and V_new as they are (exact products, fp32 accumulation)."""
    s0, ds = s0_ref[...], ds_ref[...]  # [Kt, V]
    do, v_new = do_ref[...], v_new_ref[...]
    if s0.dtype == _F32:
        do, v_new = do.astype(_F32), v_new.astype(_F32)
    dqp_ref[...] = blk.mm_nt(do.astype(s0.dtype), s0)
    dw_ref[...] = -blk.mm_nt(dv_new_ref[...], s0.astype(_F32))
    dkd_ref[...] = blk.mm_nt(v_new.astype(ds.dtype), ds)
    dd_ref[...] = jnp.sum(s0.astype(_F32) * ds.astype(_F32), axis=1)


def state_side_grads(s0, ds, v_new, do, dv_new, *, tuning, interpret, precision):
    """s0, ds: [BN, HV, K, V]; v_new, dv_new: [BN, HV, C, V]; do: [BN, C, HV, V]. Grid (chunks, value heads, key
    tiles of `state_side_tile` channels). Returns dqp, dw, dkd: [BN, HV, C, K] and dd: [BN, HV, K] (fp32)."""
    chunks, value_heads, key_dim, value_dim = s0.shape
    chunk = v_new.shape[2]
    kt = min(tuning.state_side_tile, key_dim)
    if kt < 1 or key_dim % kt:
        raise ValueError(f"Tuning.state_side_tile must be a positive divisor of the key dimension {key_dim} (or at "
                         f"least it), got {tuning.state_side_tile}")
    state = pl.BlockSpec((None, None, kt, value_dim), lambda n, h, j: (n, h, j, 0))
    values = pl.BlockSpec((None, None, chunk, value_dim), lambda n, h, j: (n, h, 0, 0))
    do_spec = pl.BlockSpec((None, chunk, None, value_dim), lambda n, h, j: (n, 0, h, 0))
    key_tile = pl.BlockSpec((None, None, chunk, kt), lambda n, h, j: (n, h, 0, j))
    key_out = jax.ShapeDtypeStruct((chunks, value_heads, chunk, key_dim), _F32)
    return pl.pallas_call(
        functools.partial(_state_side_kernel, precision=precision),
        grid=(chunks, value_heads, key_dim // kt),
        in_specs=[state, state, values, do_spec, values],
        out_specs=[key_tile] * 3 + [pl.BlockSpec((None, None, kt), lambda n, h, j: (n, h, j))],
        out_shape=[key_out] * 3 + [jax.ShapeDtypeStruct((chunks, value_heads, key_dim), _F32)],
        compiler_params=compiler_params(tuning.state_side_warps),
        interpret=interpret,
        name="kda_state_side_bwd",
    )(s0, ds, v_new, do, dv_new)


@with_precision
def _score_grad_kernel(k_ref, v_ref, g_ref, beta_ref, doc_ref, prev_ref, aqk_ref, akk_ref, t_ref, w_ref, u_ref,
                       do_ref, du_ref, dqp_ref, dw_ref, daqk_ref, dakk_ref, dkb_ref, dv_ref, dbeta_ref):
    x = ref_chunk(k_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, prev_ref, scale=1.0)
    load = lambda ref: ref[...].astype(_F32)  # noqa: E731
    daqk, dakk, dkb, dv, dbeta = backward_scores(
        x, k_base(x, jnp.cumsum(x.g, axis=0)), *map(load, (aqk_ref, akk_ref, t_ref, w_ref, u_ref, do_ref, du_ref,
                                                           dqp_ref, dw_ref)))
    daqk_ref[...], dakk_ref[...] = daqk.astype(daqk_ref.dtype), dakk.astype(dakk_ref.dtype)
    dkb_ref[...], dbeta_ref[...] = dkb, dbeta[:, 0]
    dv_ref[...] = dv.astype(dv_ref.dtype)


@with_precision
def _input_grad_kernel(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, daqk_ref, dakk_ref, dkb_ref, dqp_ref,
                       dkd_ref, dd_ref, dq_ref, dk_ref, dg_ref, *, scale, dense):
    x = ref_chunk(q_ref, k_ref, None, g_ref, beta_ref, doc_ref, prev_ref, scale=scale)
    gates = chunk_gates(x)  # the decay factors only: the scores come in as gradients, no inverse is needed
    load = lambda ref: ref[...].astype(_F32)  # noqa: E731
    dq, dk, dg = backward_inputs(x, gates, load(daqk_ref), load(dakk_ref), dkb_ref[...], dqp_ref[...], dkd_ref[...],
                                 dd_ref[...][None, :], dense=dense)
    dq_ref[...], dk_ref[...], dg_ref[...] = (dq * scale).astype(dq_ref.dtype), dk.astype(dk_ref.dtype), dg


@with_precision
def _row_block_input_grad_kernel(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, daqk_ref, dakk_ref, dkb_ref,
                                 dqp_ref, dkd_ref, dd_ref, *refs, scale, dense, diagonal=False, cumulative=False):
    """backward_inputs one 16-row block at a time, last block first, writing each block's rows of dq, dk, dg.

    Row side of block b (its queries and keys against earlier columns): [R, C] score-gradient rows times the [C, Kt]
    keys anchored at the block's first row. Column side (its keys against later rows): [C, R] score-gradient
    columns, transposed, times [C, Kt] queries and keys anchored at the block's last row (every factor <= 1 off the
    diagonal block; on it, under the bound, <= e^(15 |g_min|)). Every product is [R, C] x [C, Kt], a quarter of
    the masked [C, C] x [C, Kt] ones of the whole-tile kernel, and only [R, Kt] results are live. The suffix sums of
    dg cross blocks through a [1, Kt] carry. Unbounded: the diagonal block by nested pair groups
    (pallas_blocks.pairwise_levels_grads), as in the whole-tile kernel, or with `diagonal` read from refs (first in
    refs: diagonal_grads' dx_q, dx_k, dy; then dq, dk, dg). cumulative (Tuning.cumulative_gates): g_ref holds the
    gates' prefix sums (pallas_fwd.chunk_cumsum), and the rows this kernel needs of them are loads, not reductions.
    """
    diagonal_refs, (dq_ref, dk_ref, dg_ref) = (refs[:3], refs[3:]) if diagonal else (None, refs)
    size, key_tile = q_ref.shape
    x = ref_chunk(q_ref, k_ref, None, g_ref, beta_ref, doc_ref, prev_ref, scale=scale)
    gam = x.g if cumulative else cumsum_rows(x.g)
    gam_row = lambda r: g_ref[pl.ds(r, 1), :].astype(_F32) if cumulative else blk.row(gam, r)[None, :]  # noqa: E731
    rows_c = lax.broadcasted_iota(jnp.int32, (size, 1), 0)
    g_last = gam_row(size - 1)
    carried = jnp.where(x.doc_last == x.doc_in, jnp.exp(g_last), 0.0)
    dd = dd_ref[...][None, :]
    kd_term = x.k * jnp.where(x.in_last, jnp.exp(g_last - gam), 0.0) * dkd_ref[...]
    load = lambda ref, rows, cols=slice(None): ref[rows, cols].astype(_F32)  # noqa: E731
    suffix = jnp.zeros((1, key_tile), _F32)  # sum of dgam over the rows of later blocks
    for b in reversed(range(size // ROWS)):
        start, end = b * ROWS, (b + 1) * ROWS
        rows = pl.ds(start, ROWS)
        a = gam_row(start)
        if cumulative:
            gam_b = load(g_ref, rows)
            local = block_gam = gam_b - a  # gam - a on the block's rows, <= 0
        else:
            g_b = load(g_ref, rows)
            block_gam = cumsum_rows(g_b)
            local = block_gam - blk.row(g_b, 0)[None, :]
            gam_b = a + local
        # row side
        on_diag = (lax.broadcasted_iota(jnp.int32, (ROWS, size), 1)
                   == lax.broadcasted_iota(jnp.int32, (ROWS, size), 0) + start)
        daqk_rows = load(daqk_ref, rows)
        diag = jnp.sum(jnp.where(on_diag, daqk_rows, 0.0), axis=1)[:, None]
        limit = end if dense else start
        if limit:
            kc = x.k * jnp.exp(jnp.where(rows_c < limit, a - gam, -jnp.inf))
            with score_products():
                dqt = mm(jnp.where(on_diag, 0.0, daqk_rows), kc)
                dkt = mm(load(dakk_ref, rows), kc)
            row_factor = jnp.exp(local)
            dxq, dxk = dqt * row_factor, dkt * row_factor
        else:
            dxq = dxk = jnp.zeros((ROWS, key_tile), _F32)
        # column side
        first = start if dense else end
        if first < size:
            e = gam_row(end - 1)
            later = jnp.exp(jnp.where(rows_c >= first, gam - e, -jnp.inf))
            on_diag_t = (lax.broadcasted_iota(jnp.int32, (size, ROWS), 0)
                         == lax.broadcasted_iota(jnp.int32, (size, ROWS), 1) + start)
            with score_products():
                dy = (mm_tn(jnp.where(on_diag_t, 0.0, load(daqk_ref, slice(None), rows)), x.q * later)
                      + mm_tn(load(dakk_ref, slice(None), rows), x.k * later))
            dyk = dy * jnp.exp(e - gam_b)
        else:
            dyk = jnp.zeros((ROWS, key_tile), _F32)
        q_b, k_b = load(q_ref, rows) * scale, load(k_ref, rows)
        if diagonal:
            dxq, dxk, dyk = (dxq + load(diagonal_refs[0], rows), dxk + load(diagonal_refs[1], rows),
                             dyk + load(diagonal_refs[2], rows))
        elif not dense:
            eye = lax.broadcasted_iota(jnp.int32, (ROWS, ROWS), 0) == lax.broadcasted_iota(jnp.int32, (ROWS, ROWS), 1)
            daqk_bb = jnp.where(eye, 0.0, load(daqk_ref, rows, rows))
            dscores = (daqk_bb, load(dakk_ref, rows, rows))
            (dq_p, dk_p), dy_p = blk.pairwise_levels_grads(dscores, (q_b, k_b), k_b, block_gam)
            dxq, dxk, dyk = dxq + dq_p, dxk + dk_p, dyk + dy_p
        doc_b = doc_ref[rows]
        beta_b = beta_ref[rows].astype(_F32)[:, None]
        decay_in = jnp.where((doc_b == x.doc_in)[:, None], jnp.exp(gam_b), 0.0)
        kd_scale = jnp.where((doc_b == x.doc_last)[:, None], jnp.exp(g_last - gam_b), 0.0)
        dqp_b, dkb_b, dkd_b = load(dqp_ref, rows), load(dkb_ref, rows), load(dkd_ref, rows)
        dq = dxq + diag * k_b + decay_in * dqp_b
        dk = dyk + dxk + diag * q_b + beta_b * decay_in * dkb_b + kd_scale * dkd_b
        dgam = q_b * dxq + k_b * (dxk - dyk) + (beta_b * k_b * dkb_b + q_b * dqp_b) * decay_in
        kd_b = k_b * kd_scale * dkd_b
        before = jnp.sum(jnp.where(rows_c < start, kd_term, 0.0), axis=0)[None, :]
        block_sum = jnp.sum(dgam, axis=0)[None, :]
        dg = carried * dd + suffix + block_sum - cumsum_rows(dgam) + dgam + before + cumsum_rows(kd_b) - kd_b
        suffix = suffix + block_sum
        dq_ref[rows, :] = (dq * scale).astype(dq_ref.dtype)
        dk_ref[rows, :] = dk.astype(dk_ref.dtype)
        dg_ref[rows, :] = dg


@with_precision
def _tiled_score_grad_kernel(k_ref, v_ref, g_ref, beta_ref, doc_ref, prev_ref, aqk_ref, akk_ref, t_ref, w_ref, u_ref,
                             do_ref, du_ref, dqp_ref, dw_ref, daqk_ref, dakk_ref, dkb_ref, dv_ref, dbeta_ref, *, tile,
                             cumulative=False):
    """backward_scores `tile` channels at a time: value tiles (dv, and their share of dAqk, dL, dbeta), then key
    tiles (d(kb) and theirs). Only the [C, C] scores and gradients and [C, tile] tiles are live. cumulative: g_ref
    holds the gates' prefix sums (Tuning.cumulative_gates)."""
    size, key_dim = k_ref.shape
    value_dim = v_ref.shape[1]
    doc = doc_ref[...]
    beta = beta_ref[...].astype(_F32)[:, None]
    reads = (doc == blk.element(prev_ref[...], 0))[:, None]
    aqk, t = aqk_ref[...].astype(_F32), t_ref[...].astype(_F32)
    load = lambda ref, cols: ref[:, cols].astype(_F32)  # noqa: E731

    def value_side(j, acc):
        daqk, dl, dbeta = acc
        cols = pl.ds(j * tile, tile)
        u, do = load(u_ref, cols), load(do_ref, cols)
        dvb = blk.mm_tn(t, load(du_ref, cols) + blk.mm_tn(aqk, do))
        dv_ref[:, cols] = (beta * dvb).astype(dv_ref.dtype)
        return daqk + blk.mm_nt(do, u), dl - blk.mm_nt(dvb, u), dbeta + jnp.sum(dvb * load(v_ref, cols), axis=1)

    def key_side(j, acc):
        daqk, dl, dbeta = acc
        cols = pl.ds(j * tile, tile)
        w, dqp = load(w_ref, cols), load(dqp_ref, cols)
        gam = load(g_ref, cols) if cumulative else jnp.cumsum(load(g_ref, cols), axis=0)
        k_base = jnp.where(reads, load(k_ref, cols) * jnp.exp(gam), 0.0)
        dkb = blk.mm_tn(t, load(dw_ref, cols) - blk.mm_tn(aqk, dqp))
        dkb_ref[:, cols] = dkb
        return daqk - blk.mm_nt(dqp, w), dl - blk.mm_nt(dkb, w), dbeta + jnp.sum(dkb * k_base, axis=1)

    zeros = jnp.zeros((size, size), _F32)
    acc = lax.fori_loop(0, value_dim // tile, value_side, (zeros, zeros, jnp.zeros((size,), _F32)))
    daqk, dl, dbeta = lax.fori_loop(0, key_dim // tile, key_side, acc)
    daqk, dl = mask_scores(doc, daqk, dl)
    dbeta = dbeta + jnp.sum(dl * akk_ref[...].astype(_F32), axis=1)
    daqk_ref[...], dakk_ref[...] = daqk.astype(daqk_ref.dtype), (beta * dl).astype(dakk_ref.dtype)
    dbeta_ref[...] = dbeta


def _diagonal_grad_kernel(q_ref, k_ref, g_ref, daqk_ref, dakk_ref, dxq_ref, dxk_ref, dy_ref, *, scale):
    """Backward of pallas_fwd._diagonal_kernel for one 16-row block: with e_rc = e^(gam_r - gam_c) (r > c, every
    exponent <= 0), dx_q[r] = sum_c dAqk[r, c] k_c e_rc, dx_k[r] = sum_c dAkk[r, c] k_c e_rc and
    dy[c] = sum_r (dAqk[r, c] q_r + dAkk[r, c] k_r) e_rc, elementwise fp32 (pallas_fwd.diagonal_columns). dAqk's
    diagonal (decay 1) is left to the caller, as in pairwise_levels_grads."""
    rows, key_dim = q_ref.shape
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (rows, rows), 1)
    daqk, dakk = daqk_ref[...].astype(_F32), dakk_ref[...].astype(_F32)

    def body(c, carry, q, k, decay, key):
        dxq, dxk, dy = carry
        here = col == c
        daqk_c = jnp.sum(jnp.where(here, daqk, 0.0), axis=1, keepdims=True)  # column c, [R, 1]
        dakk_c = jnp.sum(jnp.where(here, dakk, 0.0), axis=1, keepdims=True)
        dy_c = jnp.sum((daqk_c * q + dakk_c * k) * decay, axis=0, keepdims=True)
        return dxq + daqk_c * key, dxk + dakk_c * key, jnp.where(row == c, dy_c, dy)

    zeros = jnp.zeros((rows, key_dim), _F32)
    dxq_ref[...], dxk_ref[...], dy_ref[...] = diagonal_columns(q_ref, k_ref, g_ref, body, (zeros,) * 3, scale=scale,
                                                               strict=True)


def diagonal_grads(q, k, g, daqk, dakk, *, scale, warps, interpret):
    """Backward of pallas_fwd.diagonal_scores (Tuning.diagonal_kernel) from the score gradients dAqk, dAkk
    [BN, HV, C, C] (their diagonal blocks only, read by block index (b, b)): dx_q, dx_k, dy [BN, HV, C, K] fp32 (see
    _diagonal_grad_kernel), which the row-block input backward adds in place of pairwise_levels_grads."""
    chunks, chunk, _, key_dim = q.shape
    block = pl.BlockSpec((None, None, ROWS, ROWS), lambda n, h, b: (n, h, b, b))
    out = pl.BlockSpec((None, None, ROWS, key_dim), lambda n, h, b: (n, h, b, 0))
    return diagonal_call(functools.partial(_diagonal_grad_kernel, scale=scale), q, k, g, daqk, dakk,
                         extra_specs=[block, block], out_specs=[out] * 3,
                         out_shape=[jax.ShapeDtypeStruct((chunks, g.shape[2], chunk, key_dim), _F32)] * 3,
                         warps=warps, interpret=interpret, name="kda_diagonal_bwd")


def intra_grads(q, k, v, g, beta, doc, doc_prev, saved, do, dv_new, dqp, dw, dkd, dd, *, scale, dense, tuning,
                interpret, precision):
    """Input gradients per value head, chunked like the inputs: dq, dk: [BN, C, HV, K] (to be summed over each
    q/k head's group: fp32 with grouped heads, else in q's dtype), dv: [BN, C, HV, V] in v's dtype, dg:
    [BN, C, HV, K] and dbeta: [BN, C, HV] fp32. Written in the inputs' dtypes by the kernels themselves, which
    saves a conversion pass over every gradient.

    saved: the forward's (Aqk, Akk, T, w, u). Two kernels: the first goes back through the solve to the score
    gradients (stored [BN, HV, C, C]), the second through the decayed scores to q, k and g.
    """
    kw = dict(tuning=tuning, interpret=interpret, precision=precision)
    # Tuning.cumulative_gates: both kernels read the gates' prefix sums, formed once here
    gam = chunk_cumsum(g, interpret=interpret) if tuning.cumulative_gates else None
    daqk, dakk, dkb, dv, dbeta = score_grads(k, v, g, beta, doc, doc_prev, saved, do, dv_new, dqp, dw,
                                             dv_dtype=v.dtype, gam=gam, **kw)
    grouped = v.shape[2] != q.shape[2]
    dq, dk, dg = input_grads(q, k, g, beta, doc, doc_prev, daqk, dakk, dkb, dqp, dkd, dd, scale=scale, dense=dense,
                             out_dtype=_F32 if grouped else q.dtype, gam=gam, **kw)
    return dq, dk, dv, dg, dbeta


def score_grads(k, v, g, beta, doc, doc_prev, saved, do, dv_new, dqp, dw, *, tuning, interpret, precision,
                dv_dtype=_F32, gam=None):
    """Back through ol = Aqk u, qp = qd - Aqk w and the solve: dAqk, dAkk [BN, HV, C, C] (bf16 when every per-chunk
    product rounds its operands to bf16, Tuning.backward_operands="bf16", else fp32), d(kb) [BN, HV, C, K], dv
    [BN, C, HV, V] (in dv_dtype) and the direct part of dbeta [BN, C, HV]. gam: the gates' prefix sums within each
    chunk (pallas_fwd.chunk_cumsum), read in place of g by the channel-tiled kernel if given."""
    chunks, chunk, heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2:]
    per_head = lambda d: pl.BlockSpec((None, chunk, None, d), lambda n, h: (n, 0, h, 0))  # noqa: E731
    shape = lambda d, dtype=_F32: jax.ShapeDtypeStruct((chunks, chunk, value_heads, d), dtype)  # noqa: E731
    tile_shape = lambda d, dtype=_F32: jax.ShapeDtypeStruct((chunks, value_heads, chunk, d), dtype)  # noqa: E731
    beta_spec = pl.BlockSpec((None, chunk, None), lambda n, h: (n, 0, h))
    specs = input_specs(chunk, key_dim, value_dim, value_heads // heads)
    tile = tuning.intra_tile
    precision = intra_precision(tuning, precision, k.dtype, backward=True)
    if tile and key_dim % tile == 0 and value_dim % tile == 0:
        score_kernel = functools.partial(_tiled_score_grad_kernel, precision=precision, tile=tile,
                                         cumulative=gam is not None)
        g = g if gam is None else gam
    else:
        score_kernel = functools.partial(_score_grad_kernel, precision=precision)
    daqk, dakk, dkb, dv, dbeta = pl.pallas_call(
        score_kernel,
        grid=(chunks, value_heads),
        in_specs=[specs[1]] + specs[2:] + [chunk_tile(chunk, chunk)] * 3 + [
            chunk_tile(chunk, key_dim), chunk_tile(chunk, value_dim), per_head(value_dim),
            chunk_tile(chunk, value_dim)] + [chunk_tile(chunk, key_dim)] * 2,
        out_specs=[chunk_tile(chunk, chunk)] * 2 + [chunk_tile(chunk, key_dim), per_head(value_dim), beta_spec],
        out_shape=[tile_shape(chunk, score_dtype(precision))] * 2 + [
            tile_shape(key_dim), shape(value_dim, dv_dtype), jax.ShapeDtypeStruct((chunks, chunk, value_heads), _F32)],
        compiler_params=compiler_params(tuning.score_bwd_warps),
        interpret=interpret,
        name="kda_score_bwd",
    )(k, v, g, beta, doc, doc_prev, *saved, do, dv_new, dqp, dw)
    return daqk, dakk, dkb, dv, dbeta


def input_grads(q, k, g, beta, doc, doc_prev, daqk, dakk, dkb, dqp, dkd, dd, *, scale, dense, tuning, interpret,
                precision, out_dtype=_F32, gam=None):
    """Through the decayed scores and decay factors to dq, dk (in out_dtype) and dg (fp32) [BN, C, HV, K]. gam: as
    in score_grads, read by the row-block kernel if given."""
    chunks, chunk, heads, key_dim = q.shape
    value_heads = dkb.shape[1]
    shape = lambda d, dtype=_F32: jax.ShapeDtypeStruct((chunks, chunk, value_heads, d), dtype)  # noqa: E731
    # Everything after the score gradients is elementwise in the key channel: split K over programs (half the live
    # tiles each).
    kt = min(tuning.key_tile, key_dim)
    group = value_heads // heads
    qk = pl.BlockSpec((None, chunk, None, kt), lambda n, h, j: (n, 0, h // group, j))
    head_k = pl.BlockSpec((None, chunk, None, kt), lambda n, h, j: (n, 0, h, j))
    tile_k = pl.BlockSpec((None, None, chunk, kt), lambda n, h, j: (n, h, 0, j))
    scores = pl.BlockSpec((None, None, chunk, chunk), lambda n, h, j: (n, h, 0, 0))
    rows = pl.BlockSpec((None, chunk, None), lambda n, h, j: (n, 0, h))
    doc_spec = pl.BlockSpec((None, chunk), lambda n, h, j: (n, 0))
    dd_spec = pl.BlockSpec((None, None, kt), lambda n, h, j: (n, h, j))
    kernel, extra = functools.partial(_input_grad_kernel, dense=dense), ()
    if input_bwd_rows(tuning, dense, q.dtype):
        diagonal = not dense and tuning.diagonal_kernel and chunk % ROWS == 0
        kernel = functools.partial(_row_block_input_grad_kernel, dense=dense, diagonal=diagonal,
                                   cumulative=gam is not None)
        if diagonal:
            extra = diagonal_grads(q, k, g, daqk, dakk, scale=scale, warps=tuning.diagonal_bwd_warps,
                                   interpret=interpret)
        g = g if gam is None else gam
    dq, dk, dg = pl.pallas_call(
        functools.partial(kernel, scale=scale, precision=intra_precision(tuning, precision, q.dtype, backward=True)),
        grid=(chunks, value_heads, key_dim // kt),
        in_specs=[qk, qk, head_k, rows, doc_spec, doc_spec, scores, scores, tile_k, tile_k, tile_k, dd_spec] + [
            tile_k] * len(extra),
        out_specs=[head_k] * 3,
        out_shape=[shape(key_dim, out_dtype)] * 2 + [shape(key_dim)],
        compiler_params=compiler_params(tuning.input_bwd_warps),
        interpret=interpret,
        name="kda_input_bwd",
    )(q, k, g, beta, doc, doc_prev, daqk, dakk, dkb, dqp, dkd, dd, *extra)
    return dq, dk, dg
