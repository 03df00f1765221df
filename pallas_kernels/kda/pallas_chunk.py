"""One chunk of KDA, forward and backward, as streams of 16-row blocks (DESIGN 3.1 "Chunked algorithm" and its
backward), for the Pallas kernels.

Inputs are read block by block on demand and results handed out block by block as soon as they are final: a chunk's
working set (q, k, v, g and a dozen derived [C, K] tensors) does not fit in registers, and re-reading a block costs
less than spilling. Only the cumulative decay (gam) and the small [R, R] score blocks stay live throughout.
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.kda.pallas_blocks import (ROWS, backward_subst, forward_subst, gamma_blocks, mm, mm_nt, mm_tn,
                                              nilpotent_inverse, pairwise_columns, pairwise_grads, row,
                                              score_masks)


class ChunkIn(NamedTuple):
    """One chunk's inputs: block index -> fp32 block, read on each call."""

    blocks: int
    q: Callable  # [R, K], already scaled
    k: Callable  # [R, K]
    v: Callable  # [R, V]
    g: Callable  # [R, K] per-step log decay
    beta: Callable  # [R]
    doc: Callable  # [R] int32 document index
    doc_in: jax.Array  # scalar: document of the incoming state
    doc_last: jax.Array  # scalar: document of the chunk's last token

    def reads(self, i):
        """[R, 1] bool: the row's document is the incoming state's (only those rows read S0)."""
        return (self.doc(i) == self.doc_in)[:, None]

    def in_last(self, i):
        """[R, 1] bool: the row belongs to the chunk's last document (only those rows reach the outgoing state)."""
        return (self.doc(i) == self.doc_last)[:, None]


class Core(NamedTuple):
    """What both passes derive first: the decay and the masked score blocks {(i, j): [R, R]}, j <= i."""

    gam: list  # [R, K] inclusive cumulative log decay
    g_last: jax.Array  # [K] gam of the chunk's last row
    aqk: dict  # decayed q.k, causal, same document
    akk: dict  # decayed k.k, strictly causal, same document
    l: dict  # diag(beta) akk
    t_diag: list  # (I + L_ii)^-1


def chunk_core(x: ChunkIn, *, dense) -> Core:
    gam = gamma_blocks([x.g(i) for i in range(x.blocks)])
    aqk, akk = {}, {}
    for i, gam_i in enumerate(gam):
        # Anchor on the row block's first row: off-diagonal factors <= 1, diagonal ones <= e^(15 |g_min|).
        anchor = row(gam_i, 0)[None, :]
        row_factor = jnp.exp(gam_i - anchor)
        xq, xk = x.q(i) * row_factor, x.k(i) * row_factor
        for j in range(i + 1 if dense else i):
            y = x.k(j) * jnp.exp(anchor - gam[j])
            aqk[i, j], akk[i, j] = mm_nt(xq, y), mm_nt(xk, y)
        if not dense:
            k_i = x.k(i)
            aqk[i, i], akk[i, i] = pairwise_columns((x.q(i), k_i), k_i, gam_i)
    doc = [x.doc(i) for i in range(x.blocks)]
    mask_qk, mask_kk = score_masks(doc, strict=False), score_masks(doc, strict=True)
    aqk = {ij: jnp.where(mask_qk[ij], a, 0.0) for ij, a in aqk.items()}
    akk = {ij: jnp.where(mask_kk[ij], a, 0.0) for ij, a in akk.items()}
    l = {(i, j): x.beta(i)[:, None] * a for (i, j), a in akk.items()}
    t_diag = [nilpotent_inverse(-l[i, i]) for i in range(x.blocks)]
    return Core(gam, row(gam[-1], ROWS - 1), aqk, akk, l, t_diag)


def _k_base(x, core, i):
    """K e^gam on rows that read S0 (else 0): kb = diag(beta) k_base feeds w."""
    return jnp.where(x.reads(i), x.k(i) * jnp.exp(core.gam[i]), 0.0)


def _solve_w(x, core):
    return forward_subst(core.l, core.t_diag, lambda i: x.beta(i)[:, None] * _k_base(x, core, i))


def _solve_u(x, core):
    return forward_subst(core.l, core.t_diag, lambda i: x.beta(i)[:, None] * x.v(i))


def _kd_scale(x, core, i):
    """e^(g_last - gam) on the last document's rows (else 0): kd = k * kd_scale carries rows to the chunk's end."""
    return jnp.where(x.in_last(i), jnp.exp(core.g_last[None, :] - core.gam[i]), 0.0)


def carried_decay(x, core):
    """[K] e^g_last, the decay of S0 across the chunk, or 0 when a document starts inside the chunk."""
    return jnp.where(x.doc_last == x.doc_in, jnp.exp(core.g_last), 0.0)


def chunk_forward(x: ChunkIn, core: Core, emit):
    """Calls emit(name, i, block) with name in w, u ([R, K], [R, V]: v_new = u - w S0), qp ([R, K]: o = ol + qp S0),
    ol ([R, V]) and kd ([R, K]: S_C = D S0 + kd^T v_new), one block at a time."""
    w = _solve_w(x, core)
    u = _solve_u(x, core)
    for i in range(x.blocks):
        emit("w", i, w[i])
        emit("u", i, u[i])
        qp = jnp.where(x.reads(i), x.q(i) * jnp.exp(core.gam[i]), 0.0)
        ol = 0.0
        for j in range(i + 1):
            qp = qp - mm(core.aqk[i, j], w[j])
            ol = ol + mm(core.aqk[i, j], u[j])
        emit("qp", i, qp)
        emit("ol", i, ol)
        emit("kd", i, x.k(i) * _kd_scale(x, core, i))


class ChunkGrads(NamedTuple):
    """Cotangents reaching the chunk's state-independent quantities (block index -> block)."""

    do: Callable  # [R, V] d ol = dO
    du: Callable  # [R, V] d u = dV_new
    dqp: Callable  # [R, K] dO S0^T
    dw: Callable  # [R, K] -dV_new S0^T
    dkd: Callable  # [R, K] V_new dS_C^T
    dd: jax.Array  # [K] sum_v S0 * dS_C


def chunk_backward(x: ChunkIn, core: Core, dy: ChunkGrads, emit, *, dense):
    """Calls emit(name, i, block) with dq (w.r.t. the scaled q), dk, dv, dg ([R, D]) and dbeta ([R]).

    ol = Aqk u and qp = qd - Aqk w give dAqk and the totals du, dw; u = T vb and w = T kb with T = (I + L)^-1 give
    d(vb) = T^T du, d(kb) = T^T dw and dL = -d(vb) u^T - d(kb) w^T. The u side runs to completion before the w side
    starts, so only one of them is live at a time.
    """
    doc = [x.doc(i) for i in range(x.blocks)]
    mask_qk, mask_kk = score_masks(doc, strict=False), score_masks(doc, strict=True)
    u = _solve_u(x, core)
    daqk = {(i, j): mm_nt(dy.do(i), u[j]) for (i, j) in core.aqk}
    dvb = backward_subst(core.l, core.t_diag, lambda j: dy.du(j) + sum(
        mm_tn(core.aqk[i, j], dy.do(i)) for i in range(j, x.blocks)))
    dl = {(i, j): -mm_nt(dvb[i], u[j]) for (i, j) in core.l}
    dbeta = [jnp.sum(dvb[i] * x.v(i), axis=1) for i in range(x.blocks)]
    for i in range(x.blocks):
        emit("dv", i, x.beta(i)[:, None] * dvb[i])
    del u, dvb
    w = _solve_w(x, core)
    daqk = {(i, j): jnp.where(mask_qk[i, j], a - mm_nt(dy.dqp(i), w[j]), 0.0) for (i, j), a in daqk.items()}
    dkb = backward_subst(core.l, core.t_diag, lambda j: dy.dw(j) - sum(
        mm_tn(core.aqk[i, j], dy.dqp(i)) for i in range(j, x.blocks)))
    dl = {(i, j): jnp.where(mask_kk[i, j], a - mm_nt(dkb[i], w[j]), 0.0) for (i, j), a in dl.items()}
    del w
    dakk = {(i, j): x.beta(i)[:, None] * a for (i, j), a in dl.items()}
    for i in range(x.blocks):
        dbeta[i] = dbeta[i] + jnp.sum(dkb[i] * _k_base(x, core, i), axis=1) + sum(
            jnp.sum(dl[i, j] * core.akk[i, j], axis=1) for j in range(i + 1))
    # Two terms would cancel inside the reverse cumulative sum below and leave rounding noise that is large next to a
    # small dg (strong decay): the diagonal q_r.k_r of Aqk does not depend on the decay at all, so it is taken out of
    # the score gradients and added to dq, dk directly; and kd_r = k_r e^(sum of g after r) reaches dg as an
    # exclusive prefix sum rather than as "+ every row, - its own row".
    eye = jnp.eye(ROWS, dtype=bool)
    kd_term = lambda i: x.k(i) * _kd_scale(x, core, i) * dy.dkd(i)  # noqa: E731
    kd_prefix = [0.0]
    for i in range(x.blocks - 1):
        kd_prefix.append(kd_prefix[-1] + jnp.sum(kd_term(i), axis=0)[None, :])
    carry = (carried_decay(x, core) * dy.dd)[None, :]  # e^g_last multiplies S0: its gradient reaches every row
    for j in reversed(range(x.blocks)):
        diag = jnp.sum(jnp.where(eye, daqk[j, j], 0.0), axis=1)[:, None]
        daqk[j, j] = jnp.where(eye, 0.0, daqk[j, j])
        dxq, dxk, dyk = _score_grads(x, core, daqk, dakk, j, dense=dense)
        q_j, k_j, b_j = x.q(j), x.k(j), x.beta(j)[:, None]
        reads, decay, dkb_j, dqp_j, dkd_j = x.reads(j), jnp.exp(core.gam[j]), dkb[j], dy.dqp(j), dy.dkd(j)
        emit("dq", j, dxq + diag * k_j + jnp.where(reads, decay, 0.0) * dqp_j)
        emit("dk", j, dyk + dxk + diag * q_j + jnp.where(reads, b_j * decay, 0.0) * dkb_j
             + _kd_scale(x, core, j) * dkd_j)
        dgam = q_j * dxq + k_j * (dxk - dyk) + jnp.where(reads, (b_j * k_j * dkb_j + q_j * dqp_j) * decay, 0.0)
        total = jnp.sum(dgam, axis=0)[None, :]
        kd_j = kd_term(j)
        emit("dg", j, carry + total - jnp.cumsum(dgam, axis=0) + dgam  # transpose of the cumulative sum
             + kd_prefix[j] + jnp.cumsum(kd_j, axis=0) - kd_j)
        carry = carry + total
        emit("dbeta", j, dbeta[j])


def _score_grads(x, core, daqk, dakk, j, *, dense):
    """Block j's gradients through the decayed scores: towards q_j and k_j as rows, and k_j as columns.

    Rows use the forward's anchor (block j's first row). Columns anchor on block j's LAST row sigma, so that every
    later row block's factor e^(gam_i - sigma) is <= 1 and e^(sigma - gam_j) <= 1.
    """
    gam = core.gam
    anchor = row(gam[j], 0)[None, :]
    dxq = dxk = 0.0
    for c in range(j + 1 if dense else j):
        y = x.k(c) * jnp.exp(anchor - gam[c])
        dxq, dxk = dxq + mm(daqk[j, c], y), dxk + mm(dakk[j, c], y)
    row_factor = jnp.exp(gam[j] - anchor)
    dxq, dxk = dxq * row_factor, dxk * row_factor
    sigma = row(gam[j], ROWS - 1)[None, :]
    dyk = 0.0
    for i in range(j if dense else j + 1, x.blocks):
        factor = jnp.exp(gam[i] - sigma)
        dyk = dyk + mm_tn(daqk[i, j], x.q(i) * factor) + mm_tn(dakk[i, j], x.k(i) * factor)
    dyk = dyk * jnp.exp(sigma - gam[j])
    if not dense:
        k_j = x.k(j)
        (diag_dxq, diag_dxk), diag_dy = pairwise_grads((daqk[j, j], dakk[j, j]), (x.q(j), k_j), k_j, gam[j])
        dxq, dxk, dyk = dxq + diag_dxq, dxk + diag_dxk, dyk + diag_dy
    return dxq, dxk, dyk
