"""Chunked KDA in plain jnp (DESIGN 3.1, "Chunked algorithm"): the CPU path and the kernels' fallback.

The work inside each chunk of C tokens runs in parallel over chunks; only the K x V state crosses chunks, through a
lax.scan. Everything is fp32 with HIGHEST matmul precision (no TF32), so it matches the token-by-token reference.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda.layout import document_index, expand_heads

_HIGHEST = lax.Precision.HIGHEST
_mm = functools.partial(jnp.matmul, precision=_HIGHEST)
_einsum = functools.partial(jnp.einsum, precision=_HIGHEST)


class _Chunk(NamedTuple):
    """What the inter-chunk scan needs from one chunk (C tokens, K key and V value channels)."""

    a_qk: jax.Array  # [C, C] decayed q.k scores, causal, same document only
    u: jax.Array  # [C, V] T diag(beta) V
    w: jax.Array  # [C, K] T diag(beta) (K * e^Gamma), zero on rows that do not read the incoming state
    q_decayed: jax.Array  # [C, K] Q * e^Gamma, zero on rows that do not read the incoming state
    k_to_end: jax.Array  # [C, K] K * e^(Gamma_C - Gamma), zero outside the chunk's last document
    s0_decay: jax.Array  # [K] e^Gamma_C, or 0 when a document starts inside the chunk


def chunk_kda_xla(q, k, v, g, beta, initial_state, segment_ids, *, scale, chunk_size, diagonal):
    """Chunked KDA forward; differentiable by plain autodiff.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]; initial_state: [B, HV, K, V] fp32;
    segment_ids: [B, T] int or None; T a multiple of chunk_size; diagonal: ("dense" | "pairwise", R) from
    kda_diagonal_path. Returns o [B, T, HV, V] fp32 and the final state [B, HV, K, V] fp32.
    """
    path, rows = diagonal
    f32 = jnp.float32
    batch, seq_len, _, key_dim = q.shape
    num_value_heads, value_dim = v.shape[2:]
    num_chunks = seq_len // chunk_size
    q = expand_heads(q.astype(f32), num_value_heads) * scale
    k = expand_heads(k.astype(f32), num_value_heads)
    if segment_ids is None:
        doc = jnp.zeros((batch, seq_len), jnp.int32)
    else:
        doc = document_index(segment_ids)
    # Chunk n's incoming state belongs to the document of token n*C - 1 (for chunk 0: the first document).
    doc_in = jnp.concatenate([doc[:, :1], doc[:, :-1]], axis=1)[:, ::chunk_size]  # [B, N]
    doc = jnp.broadcast_to(doc[:, :, None], (batch, seq_len, num_value_heads))

    # One flat batch axis of (chunk, batch, head) for the parallel part: nested vmaps of batched matmuls with many
    # batch axes crash XLA's CPU algebraic simplifier (jax 0.11.2).
    def flat_chunks(x):  # [B, T, HV, ...] -> [N * B * HV, C, ...]
        x = x.reshape(batch, num_chunks, chunk_size, num_value_heads, *x.shape[3:])
        return jnp.moveaxis(x, 3, 2).swapaxes(0, 1).reshape(-1, chunk_size, *x.shape[4:])

    inputs = [flat_chunks(x) for x in (q, k, v.astype(f32), g.astype(f32), beta.astype(f32), doc)]
    doc_in = jnp.broadcast_to(doc_in.T[:, :, None], (num_chunks, batch, num_value_heads)).reshape(-1)
    prepare = jax.vmap(functools.partial(_prepare_chunk, rows=rows, dense=path == "dense"))
    chunks = jax.tree.map(lambda x: x.reshape(num_chunks, batch * num_value_heads, *x.shape[1:]),
                          prepare(*inputs, doc_in))
    s0 = initial_state.reshape(batch * num_value_heads, key_dim, value_dim)
    state, o = lax.scan(jax.vmap(_carry_state), s0, chunks)  # o: [N, B * HV, C, V]
    o = o.reshape(num_chunks, batch, num_value_heads, chunk_size, value_dim)
    o = jnp.moveaxis(o, 2, 3).swapaxes(0, 1).reshape(batch, seq_len, num_value_heads, value_dim)
    return o, state.reshape(batch, num_value_heads, key_dim, value_dim)


def _carry_state(s0, chunk):
    """One step of the inter-chunk recurrence. s0: [K, V] incoming state. -> (outgoing state [K, V], o [C, V])."""
    v_new = chunk.u - _mm(chunk.w, s0)
    o = _mm(chunk.q_decayed, s0) + _mm(chunk.a_qk, v_new)
    state = chunk.s0_decay[:, None] * s0 + _mm(chunk.k_to_end.T, v_new)
    return state, o


def _prepare_chunk(q, k, v, g, beta, doc, doc_in, *, rows, dense):
    """Everything of one chunk that does not depend on its incoming state.

    q (scaled), k, g: [C, K]; v: [C, V]; beta: [C]; doc: [C] document index; doc_in: [] document of the incoming state.
    A document start inside the chunk keeps it exact: pairs across documents are masked, rows of a later document do
    not read the incoming state, and only the last document's rows (and no decayed S0) reach the outgoing state.
    """
    size = q.shape[0]
    strict = jnp.tri(size, k=-1, dtype=bool) & (doc[:, None] == doc[None, :])
    scores = _decayed_scores(jnp.stack([q, k]), k, g, rows=rows, dense=dense)
    # The diagonal needs no decay; taking it apart keeps its O(1) terms out of the decay gradient, where they would
    # enter once with each sign and cancel only up to rounding.
    a_qk = jnp.where(strict, scores[0], 0.0) + jnp.diag(jnp.sum(q * k, axis=-1))
    t = _unit_lower_inverse(jnp.where(strict, beta[:, None] * scores[1], 0.0), rows)
    # Decays from the chunk start through each row, and from after each row to the chunk end, each summed over exactly
    # the steps it spans: a difference of two long cumulative sums would lose absolute precision under large decays.
    steps = jnp.arange(size)
    decay_in = jnp.exp(_sum_over(steps[None, :] <= steps[:, None], g))  # [C, K]: steps 0..r
    decay_out = jnp.exp(_sum_over(steps[None, :] > steps[:, None], g))  # [C, K]: steps c+1..C-1
    reads_s0 = (doc == doc_in)[:, None]
    u = _mm(t, beta[:, None] * v)
    # T is block-diagonal by document, so zeroing these rows of K * e^Gamma zeroes the same rows of W.
    w = _mm(t, beta[:, None] * jnp.where(reads_s0, k * decay_in, 0.0))
    q_decayed = jnp.where(reads_s0, q * decay_in, 0.0)
    k_to_end = jnp.where((doc == doc[-1])[:, None], k * decay_out, 0.0)
    s0_decay = jnp.where(reads_s0[-1], decay_in[-1], 0.0)
    return _Chunk(a_qk, u, w, q_decayed, k_to_end, s0_decay)


def _sum_over(mask, g):
    """sum_s mask[..., s] g[s] for a 0/1 mask: [..., S] and g: [S, K] -> [..., K].

    Every decay exponent is a sum of g over exactly the steps it spans, never a difference of two long cumulative
    sums, which loses absolute precision once decays are large. As a matmul (products by 0 or 1 are exact) it also
    compiles to one op instead of a cumulative sum's log-depth scan.
    """
    return _einsum("...s,sk->...k", mask.astype(g.dtype), g)


def _decayed_scores(x, k, g, *, rows, dense):
    """sum_d x[p, r, d] k[c, d] e^(gamma[r, d] - gamma[c, d]) for every c < r (the diagonal and above: finite junk).

    x: [P, C, K] row vectors (q and k stacked); k, g: [C, K] with gamma = cumsum(g). Returns [P, C, C].
    Row block i is one matmul anchored at its row 0, rho = gamma[i*R]: the row factor e^(gamma_r - rho) <= 1 and, for
    earlier columns, e^(rho - gamma_c) <= 1 since gamma never increases, so off-diagonal blocks are always safe.
    Dense mode puts the diagonal block in the same matmul, where e^(rho - gamma_c) <= e^((R-1)|g_min|), finite by the
    tiling's choice of R; otherwise the diagonal blocks come from exact pairwise differences. Never anchor at a
    midpoint: in a partial trailing block that is a future token, and rounding would leak future gates into the past.
    """
    p, size, d = x.shape
    blocks = size // rows
    steps = jnp.arange(size)
    block = steps // rows
    anchor = block * rows  # [C]: row 0 of each step's block
    # Row factor exponent gamma_r - rho: steps after r's anchor through r.
    from_anchor = _sum_over((steps > anchor[:, None]) & (steps <= steps[:, None]), g)  # [C, K]
    # Column exponent rho_i - gamma_c for row block i: -(steps c+1 .. i*R) for earlier columns, which is <= 0, and
    # +(steps i*R+1 .. c) for columns of block i itself (dense mode only), which is <= (R - 1)|g_min|.
    anchors = jnp.arange(blocks)[:, None, None] * rows  # [nb, 1, 1]
    earlier = (steps[None, :, None] < steps) & (steps <= anchors)  # [nb, C (column), C (step)]
    own = (anchors < steps) & (steps <= steps[None, :, None])
    col_exponent = _sum_over(earlier, g) - _sum_over(own, g)  # [nb, C, K]; one term is always empty
    row_block = jnp.arange(blocks)[:, None]
    visible = (block < row_block) | ((block == row_block) & dense)  # [nb, C]
    # Masked exponents, not masked exponentials: hidden entries are exp(-inf) = 0 with a zero (not NaN) gradient.
    k_cols = k * jnp.exp(jnp.where(visible[..., None], col_exponent, -jnp.inf))  # [nb, C, K]
    x_rows = (x * jnp.exp(from_anchor)).reshape(p, blocks, rows, d)
    scores = _einsum("pird,icd->pirc", x_rows, k_cols).reshape(p, size, size)
    if not dense:
        scores = scores + _pairwise_diagonal(x, k, g.reshape(blocks, rows, d))
    return scores


def _pairwise_diagonal(x, k, g_blocks):
    """Diagonal R x R blocks of the decayed scores from exact segment sums of g: safe for any decay.

    x: [P, C, K]; k: [C, K]; g_blocks: [nb, R, K]. Returns [P, C, C], zero outside the diagonal blocks and on or above
    the diagonal.
    """
    p, size, d = x.shape
    blocks, rows, _ = g_blocks.shape
    r, c, s = jnp.ogrid[:rows, :rows, :rows]
    diff = jnp.einsum("rcs,nsk->nrck", ((c < s) & (s <= r)).astype(g_blocks.dtype), g_blocks,
                      precision=_HIGHEST)  # [nb, R, R, K]: steps c+1 .. r
    strict = jnp.tri(rows, k=-1, dtype=bool)[None, :, :, None]  # [1, r, c, 1]: c < r
    decay = jnp.exp(jnp.where(strict, diff, -jnp.inf))  # masked before exp: no overflow, no NaN gradient
    diag = _einsum("pnrd,ncd,nrcd->pnrc", x.reshape(p, blocks, rows, d), k.reshape(blocks, rows, d), decay)
    on_diagonal = jnp.eye(blocks, dtype=bool)[:, None, :, None]  # [nb, 1, nb, 1]
    return jnp.where(on_diagonal, diag[:, :, :, None, :], 0.0).reshape(p, size, size)


def _unit_lower_inverse(l, rows):
    """(I + L)^-1 for strictly lower-triangular l: [C, C], with R = rows dividing C.

    Each R x R diagonal block D_i = I + L_ii is inverted by the product formula (no serial substitution). The blocks
    are then joined with the same formula one level up: I + L = D (I - N) with N = -D^-1 L_off block-strictly-lower,
    so N^(C/R) = 0 and (I + L)^-1 = (I - N)^-1 D^-1, log2(C/R) more factors of C x C matmuls.
    """
    size = l.shape[0]
    blocks = size // rows
    l_blocks = l.reshape(blocks, rows, blocks, rows)
    idx = jnp.arange(blocks)
    diag_inverse = _nilpotent_inverse(-l_blocks[idx, :, idx, :])  # [nb, R, R]
    if blocks == 1:
        return diag_inverse[0]
    on_diagonal = jnp.eye(blocks, dtype=bool)[:, None, :, None]
    l_off = jnp.where(on_diagonal, 0.0, l_blocks).reshape(blocks, rows, size)
    n = -_einsum("irs,isc->irc", diag_inverse, l_off).reshape(size, size)
    d_inverse = jnp.where(on_diagonal, diag_inverse[:, :, None, :], 0.0).reshape(size, size)
    return _mm(_nilpotent_inverse(n, blocks), d_inverse)


def _nilpotent_inverse(n, order=None):
    """(I - N)^-1 = (I + N)(I + N^2)(I + N^4)... for n: [..., M, M] with N^order = 0 (default M, a power of two)."""
    order = order or n.shape[-1]
    eye = jnp.eye(n.shape[-1], dtype=n.dtype)
    inverse, power = eye + n, n
    for _ in range(order.bit_length() - 2):  # log2(order) factors in all
        power = _mm(power, power)
        inverse = _mm(inverse, eye + power)
    return inverse
