"""One chunk of KDA, forward and backward, on whole [C, D] tiles (DESIGN 3.1 "Chunked algorithm" and its backward),
for the Pallas kernels.

Every product is a whole-chunk matmul ([C, K] x [K, C], [C, C] x [C, D]): the tensor cores get 64-row operands and
the kernels stay a few dozen dots long instead of hundreds of 16x16 ones. The 16-row sub-chunk structure lives in
masks: row block i of a decayed score matrix is (Q e^(gam - a_i)) (K e^(a_i - gam))^T with a_i the cumulative decay
of the block's FIRST row, the column factor masked to the columns the block may see (its exponent set to -inf before
the exp, never after), the product kept on block i's rows only. Under the bound the diagonal block is part of that
one product (dense); without it, the columns stop before the block and the diagonal blocks come from four more
masked whole-chunk products, by nested pair groups whose decay factors are all <= 1 (pallas_blocks.pairwise_levels).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda.pallas_blocks import (ROWS, cumsum_rows, mm, mm_nt, mm_tn, nilpotent_inverse, pairwise_levels,
                                              pairwise_levels_grads, row, score_products)

_F32 = jnp.float32


class CumulativeGates(NamedTuple):
    """A chunk's gates as its kernel reads them from their prefix sums in memory: the anchor rows and the last row
    are loads, not reductions across the tile."""

    gam: jax.Array  # [C, K] inclusive cumulative log decay
    anchors: list  # [1, K] gam of each 16-row block's first row
    last: jax.Array  # [1, K] gam of the chunk's last row


class ChunkIn(NamedTuple):
    """One chunk's inputs as fp32 tiles."""

    q: jax.Array  # [C, K], already scaled
    k: jax.Array  # [C, K]
    v: jax.Array  # [C, V] (None where a kernel does not need it)
    g: jax.Array  # [C, K] per-step log decay
    beta: jax.Array  # [C, 1]
    doc: jax.Array  # [C] (or [C, 1]) int32 document index
    doc_in: jax.Array  # scalar (or [1, 1]): document of the incoming state
    doc_last: jax.Array  # scalar (or [1, 1]): document of the chunk's last token
    # [1, C]: doc as a row, where the kernel has it in that layout (Mosaic TPU: no [C] vectors); None: from doc.
    doc_row: jax.Array = None
    # The gates already summed (Tuning.cumulative_gates: CumulativeGates read from the prefix-sum kernel's output);
    # g is then None.
    cumulative: CumulativeGates = None

    def _same_doc(self, other):
        """[C, 1] bool: doc == other, from a [C] doc (then widened) or a [C, 1] one."""
        return self.doc == other if self.doc.ndim == 2 else (self.doc == other)[:, None]

    @property
    def reads(self):
        """[C, 1] bool: rows of the incoming state's document (only they read S0)."""
        return self._same_doc(self.doc_in)

    @property
    def in_last(self):
        """[C, 1] bool: rows of the chunk's last document (only they reach the outgoing state)."""
        return self._same_doc(self.doc_last)


def _iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


class Decay(NamedTuple):
    gam: jax.Array  # [C, K] inclusive cumulative log decay
    anchors: list  # a_i: [1, K] gam of block i's first row
    row_block: jax.Array  # [C, 1] block index of each row
    row_factor: jax.Array  # [C, K] e^(gam - a_(block of the row)) <= 1


def decay(g, cumulative=None):
    """The decay factors from the gates g [C, K], or from their prefix sums (cumulative: CumulativeGates)."""
    if cumulative is None:
        gam = cumsum_rows(g)
        anchors = [row(gam, ROWS * i)[None, :] for i in range(gam.shape[0] // ROWS)]
    else:
        gam, anchors = cumulative.gam, cumulative.anchors
    size = gam.shape[0]
    row_block = _iota((size, 1), 0) // ROWS
    anchor = sum(jnp.where(row_block == i, a, 0.0) for i, a in enumerate(anchors))
    return Decay(gam, anchors, row_block, jnp.exp(gam - anchor))


def column_blocks(dec, *, dense):
    """(i, e^(a_i - gam) on the columns row block i reads through the anchored product, 0 beyond): [C, K]."""
    out = []
    for i, a in enumerate(dec.anchors):
        limit = ROWS * (i + 1 if dense else i)
        if limit:
            out.append((i, jnp.exp(jnp.where(_iota(dec.gam.shape, 0) < limit, a - dec.gam, -jnp.inf))))
    return out


def masks(doc, doc_row=None):
    """Same-document causal masks [C, C]: Aqk (c <= r) and L (c < r). doc: [C] or [C, 1]; doc_row: [1, C] or None."""
    size = doc.shape[0]
    r, c = _iota((size, size), 0), _iota((size, size), 1)
    same = (doc if doc.ndim == 2 else doc[:, None]) == (doc[None, :] if doc_row is None else doc_row)
    return same & (r >= c), same & (r > c)


def _interleave(tiles):
    """[R, D] tiles (a power-of-two count) -> one [R, D * count] tile holding all of them, interleaved along the last
    axis by pairwise stacks (what Pallas' Triton lowering supports). Two operands built alike contract as the sum of
    the tiles' contractions: a contraction does not depend on the order of its axis."""
    while len(tiles) > 1:
        tiles = [jnp.stack(pair, axis=-1).reshape(pair[0].shape[0], -1) for pair in zip(tiles[::2], tiles[1::2])]
    return tiles[0]


def partial_scores(x: ChunkIn, dec: Decay, *, dense, with_diagonal=True, fused=False):
    """Decayed scores summed over the key channels of x only, unmasked: (Aqk, Akk) [C, C]. Summing the results of
    key-channel tiles gives the whole products (every factor is elementwise in the key channel). Pairwise path with
    with_diagonal=False: the diagonal blocks are left out (pallas_blocks.pairwise_levels adds them).

    fused: row block i's rows are selected in the left operand (the other rows zeroed) and the row blocks' operands
    are laid side by side along the contracted axis, so that each score is one product with a 4x longer contraction
    instead of one masked [C, C] product per row block (each held in registers until it is masked and added)."""
    size = x.q.shape[0]
    qt, kt = x.q * dec.row_factor, x.k * dec.row_factor
    blocks = column_blocks(dec, dense=dense)
    with score_products():
        if fused:
            pad = [jnp.zeros_like(x.k)] * (size // ROWS - len(blocks))  # unbounded: no block 0 (a power-of-two count)
            on_block = [dec.row_block == i for i, _ in blocks]
            kc = _interleave(pad + [x.k * col_factor for _, col_factor in blocks])
            aqk, akk = (mm_nt(_interleave(pad + [jnp.where(m, t, 0.0) for m in on_block]), kc) for t in (qt, kt))
        else:
            aqk = akk = jnp.zeros((size, size), _F32)
            for i, col_factor in blocks:
                kc = x.k * col_factor
                on_block = dec.row_block == i
                aqk = aqk + jnp.where(on_block, mm_nt(qt, kc), 0.0)
                akk = akk + jnp.where(on_block, mm_nt(kt, kc), 0.0)
    if not dense and with_diagonal:
        diag_qk, diag_kk = pairwise_levels((x.q, x.k), x.k, dec.gam)
        aqk, akk = aqk + diag_qk, akk + diag_kk
    return aqk, akk


def mask_scores(doc, aqk, akk, doc_row=None):
    """Same-document causal masks applied: Aqk keeps c <= r, Akk c < r."""
    mask_qk, mask_kk = masks(doc, doc_row)
    return jnp.where(mask_qk, aqk, 0.0), jnp.where(mask_kk, akk, 0.0)


def scores(x: ChunkIn, dec: Decay, *, dense):
    """Masked decayed scores: Aqk [C, C] (c <= r) and Akk [C, C] (c < r)."""
    return mask_scores(x.doc, *partial_scores(x, dec, dense=dense), doc_row=x.doc_row)


def unit_lower_inverse(l):
    """(I + L)^-1 for strictly lower L [C, C]: the 16x16 diagonal blocks D by Neumann products (N^16 = 0), then
    (I + L)^-1 = (I + M)^-1 (I + D)^-1 with M = (I + D)^-1 (L - D) strictly block-lower (M^(C/16) = 0)."""
    size = l.shape[0]
    same_block = _iota((size, size), 0) // ROWS == _iota((size, size), 1) // ROWS
    t_diag = nilpotent_inverse(-jnp.where(same_block, l, 0.0), ROWS)
    if size == ROWS:
        return t_diag
    m = mm(t_diag, jnp.where(same_block, 0.0, l))
    return mm(nilpotent_inverse(-m, size // ROWS), t_diag)


def k_base(x: ChunkIn, gam):
    """[C, K] K e^gam on rows that read S0 (else 0): kb = diag(beta) k_base feeds w."""
    return jnp.where(x.reads, x.k * jnp.exp(gam), 0.0)


def q_base(x: ChunkIn, gam):
    """[C, K] Q e^gam on rows that read S0 (else 0): what multiplies S0 in o."""
    return jnp.where(x.reads, x.q * jnp.exp(gam), 0.0)


class Core(NamedTuple):
    """What both passes derive first."""

    dec: Decay
    aqk: jax.Array  # [C, C]
    akk: jax.Array  # [C, C]
    t: jax.Array  # [C, C] (I + diag(beta) Akk)^-1
    k_base: jax.Array  # [C, K] K e^gam on rows that read S0 (else 0)
    kd_scale: jax.Array  # [C, K] e^(g_last - gam) on the last document's rows (else 0)
    carried: jax.Array  # [1, K] e^g_last, the decay of S0 across the chunk (0 when a document starts inside)


class Gates(NamedTuple):
    """The decay factors of one chunk (or of a tile of its key channels): everything but the scores."""

    dec: Decay
    k_base: jax.Array  # [C, K] K e^gam on rows that read S0 (else 0)
    kd_scale: jax.Array  # [C, K] e^(g_last - gam) on the last document's rows (else 0)
    carried: jax.Array  # [1, K] e^g_last, the decay of S0 across the chunk (0 when a document starts inside)


def chunk_gates(x: ChunkIn) -> Gates:
    dec = decay(x.g, x.cumulative)
    g_last = row(dec.gam, dec.gam.shape[0] - 1)[None, :] if x.cumulative is None else x.cumulative.last
    kd_scale = jnp.where(x.in_last, jnp.exp(g_last - dec.gam), 0.0)
    carried = jnp.where(x.doc_last == x.doc_in, jnp.exp(g_last), 0.0)
    return Gates(dec, k_base(x, dec.gam), kd_scale, carried)


def chunk_core(x: ChunkIn, *, dense) -> Core:
    gates = chunk_gates(x)
    aqk, akk = scores(x, gates.dec, dense=dense)
    t = unit_lower_inverse(x.beta * akk)
    return Core(gates.dec, aqk, akk, t, gates.k_base, gates.kd_scale, gates.carried)


def key_outputs(x: ChunkIn, gates: Gates, aqk, t):
    """The forward's outputs that are elementwise in the key channel, for x's channels: w, qp, kd [C, K], d [1, K].
    aqk None: w, kd, d only (what the state scan reads)."""
    w = mm(t, x.beta * gates.k_base)
    out = dict(w=w, kd=x.k * gates.kd_scale, d=gates.carried)
    if aqk is not None:
        out["qp"] = q_base(x, gates.dec.gam) - mm(aqk, w)
    return out


def value_outputs(v, beta, aqk, t):
    """u = T diag(beta) V and ol = Aqk u for a tile of value channels: [C, V]. aqk None: u only."""
    u = mm(t, beta * v)
    return dict(u=u) if aqk is None else dict(u=u, ol=mm(aqk, u))


def chunk_forward(x: ChunkIn, core: Core):
    """w, u (v_new = u - w S0), qp (o = ol + qp S0), ol, kd (S_C = D S0 + kd^T v_new) and D = carried."""
    gates = Gates(core.dec, core.k_base, core.kd_scale, core.carried)
    return key_outputs(x, gates, core.aqk, core.t) | value_outputs(x.v, x.beta, core.aqk, core.t)


def backward_scores(x: ChunkIn, k_base, aqk, akk, t, w, u, do, du, dqp, dw):
    """First half of the chunk's backward: through ol = Aqk u, qp = qd - Aqk w, u = T vb, w = T kb, T = (I + L)^-1,
    from the forward's saved Aqk, Akk, T [C, C] and w, u.

    do, du: [C, V] (dO, dV_new); dqp, dw: [C, K]. Returns dAqk, dAkk [C, C] (masked), d(kb) [C, K], dv [C, V] and the
    part of dbeta [C, 1] that does not go through the scores' decay. The value side runs before the key side, so
    only one of them is live at a time.
    """
    dvb = mm_tn(t, du + mm_tn(aqk, do))
    daqk, dl = mm_nt(do, u), -mm_nt(dvb, u)
    dbeta = jnp.sum(dvb * x.v, axis=1)
    dv = x.beta * dvb
    dkb = mm_tn(t, dw - mm_tn(aqk, dqp))
    daqk, dl = daqk - mm_nt(dqp, w), dl - mm_nt(dkb, w)
    mask_qk, mask_kk = masks(x.doc, x.doc_row)
    daqk, dl = jnp.where(mask_qk, daqk, 0.0), jnp.where(mask_kk, dl, 0.0)
    dbeta = dbeta + jnp.sum(dkb * k_base, axis=1) + jnp.sum(dl * akk, axis=1)
    return daqk, x.beta * dl, dkb, dv, dbeta[:, None]


def backward_inputs(x: ChunkIn, core: Gates, daqk, dakk, dkb, dqp, dkd, dd, *, dense):
    """Second half: through the decayed scores and the decay factors to dq (w.r.t. the scaled q), dk and dg.
    daqk, dakk: [C, C] score gradients (masked); dd: [1, K]."""
    dec, size = core.dec, x.q.shape[0]
    eye = _iota((size, size), 0) == _iota((size, size), 1)
    # The diagonal q_r.k_r of Aqk has no decay: taken out of the score gradients so that its terms in dgam
    # (q dq - k dk, equal and opposite) do not leave rounding noise next to a small dg.
    diag = jnp.sum(jnp.where(eye, daqk, 0.0), axis=1)[:, None]
    daqk = jnp.where(eye, 0.0, daqk)
    # Column side first, then row side: two accumulators live at a time rather than three.
    qt, kt = x.q * dec.row_factor, x.k * dec.row_factor
    dyk = jnp.zeros_like(x.q)
    with score_products():
        for i, col_factor in column_blocks(dec, dense=dense):
            on_block = dec.row_block == i
            dyk = dyk + (mm_tn(jnp.where(on_block, daqk, 0.0), qt)
                         + mm_tn(jnp.where(on_block, dakk, 0.0), kt)) * col_factor
        dqt = dkt = jnp.zeros_like(x.q)
        for i, col_factor in column_blocks(dec, dense=dense):
            on_block = dec.row_block == i
            kc = x.k * col_factor
            dqt, dkt = dqt + mm(jnp.where(on_block, daqk, 0.0), kc), dkt + mm(jnp.where(on_block, dakk, 0.0), kc)
    dxq, dxk = dqt * dec.row_factor, dkt * dec.row_factor
    if not dense:  # the diagonal blocks (daqk's diagonal is out already, dakk's is zero)
        (dq_p, dk_p), dy_p = pairwise_levels_grads((daqk, dakk), (x.q, x.k), x.k, dec.gam)
        dxq, dxk, dyk = dxq + dq_p, dxk + dk_p, dyk + dy_p
    decay_in = jnp.where(x.reads, jnp.exp(dec.gam), 0.0)
    dq = dxq + diag * x.k + decay_in * dqp
    dk = dyk + dxk + diag * x.q + x.beta * decay_in * dkb + core.kd_scale * dkd
    dgam = x.q * dxq + x.k * (dxk - dyk) + (x.beta * x.k * dkb + x.q * dqp) * decay_in
    # kd_r = k_r e^(g_last - gam_r) depends on the gates after r: an exclusive prefix sum, not "+ all - own row".
    kd_term = x.k * core.kd_scale * dkd
    dg = (core.carried * dd + jnp.sum(dgam, axis=0)[None, :] - cumsum_rows(dgam) + dgam
          + cumsum_rows(kd_term) - kd_term)
    return dq, dk, dg
