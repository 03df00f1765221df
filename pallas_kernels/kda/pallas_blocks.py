"""Per-chunk KDA algebra on 16-row sub-chunk blocks, written with the jnp ops that Pallas kernels lower.

Sub-chunk blocks have R = 16 rows. Everything is fp32; matmuls accumulate in fp32.

Decayed scores  A[r, c] = sum_d x[r, d] y[c, d] e^(gam[r, d] - gam[c, d])  (c <= r)  are one matmul per block pair with
the row block's first row as anchor rho_i: (x_i * e^(gam_i - rho_i)) (y_j * e^(rho_i - gam_j))^T. Off-diagonal factors
are <= 1; on the diagonal e^(rho_i - gam_c) <= e^(15 |g_min|), finite under the bound ("dense"). Without a bound the
diagonal blocks are exact by nested pair groups instead ("pairwise", pairwise_levels). Never anchor on a later row
of the row block: that row is a future token for the earlier rows, and its gate would leak into their outputs through
rounding.
"""

import contextlib
import contextvars

import jax.numpy as jnp
from jax import lax

ROWS = 16  # sub-chunk height: (ROWS - 1) * |g_min| must stay under fp32 exp's range for the dense diagonal
_F32 = jnp.float32
# Matmul algorithm while a kernel body is traced: None (TF32 operands on GPU tensor cores, enough for bf16 inputs) or
# a lax.DotAlgorithmPreset such as TF32_TF32_F32_X3 for fp32 inputs. Set with matmul_precision, never globally.
_PRECISION = contextvars.ContextVar("kda_matmul_precision", default=None)
# True while a Mosaic TPU kernel body is traced: prefix sums become triangular matmuls (Mosaic TPU has no cumsum).
_MATMUL_SCANS = contextvars.ContextVar("kda_matmul_scans", default=False)


@contextlib.contextmanager
def matmul_precision(precision):
    token = _PRECISION.set(precision)
    try:
        yield
    finally:
        _PRECISION.reset(token)


@contextlib.contextmanager
def matmul_scans():
    """Within: cumsum_rows is a lower-triangular ones matmul at fp32 precision (for Mosaic TPU) instead of a scan."""
    token = _MATMUL_SCANS.set(True)
    try:
        yield
    finally:
        _MATMUL_SCANS.reset(token)


def cumsum_rows(x):
    """Inclusive prefix sum over axis 0 of [R, D]."""
    if not _MATMUL_SCANS.get():
        return jnp.cumsum(x, axis=0)
    size = x.shape[0]
    lower = (_iota((size, size), 0) >= _iota((size, size), 1)).astype(_F32)
    return lax.dot_general(lower, x, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=_F32)


# matmul_precision values for 16-bit inputs: both operands rounded to bf16 with fp32 accumulation (the tensor
# cores' bf16 rate and half the operand registers of TF32) in every product (BF16_OPERANDS), or only in the decayed
# score products and their gradients (BF16_SCORES: inside score_products(); TF32 elsewhere).
BF16_OPERANDS = "bf16_operands"
BF16_SCORES = "bf16_scores"
_IN_SCORES = contextvars.ContextVar("kda_in_score_products", default=False)


@contextlib.contextmanager
def score_products():
    """Marks the decayed-score products ((q, k) tiles times decay factors <= 1, and their gradients)."""
    token = _IN_SCORES.set(True)
    try:
        yield
    finally:
        _IN_SCORES.reset(token)


def _dot(a, b, dims):
    precision = _PRECISION.get()
    if precision in (BF16_OPERANDS, BF16_SCORES):
        if precision == BF16_OPERANDS or _IN_SCORES.get():
            a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        precision = None
    return lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=_F32)


def mm(a, b):
    """a @ b for [m, k] x [k, n], fp32 accumulation."""
    return _dot(a, b, ((1,), (0,)))


def mm_nt(a, b):
    """a @ b.T for [m, k] x [n, k]."""
    return _dot(a, b, ((1,), (1,)))


def mm_tn(a, b):
    """a.T @ b for [k, m] x [k, n]."""
    return _dot(a, b, ((0,), (0,)))


def _iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def row(x, i):
    """Row i (static or traced) of x: [R, D] -> [D], as a masked sum (exact: one non-zero term)."""
    return jnp.sum(jnp.where(_iota(x.shape, 0) == i, x, 0), axis=0)


def element(x, i):
    """x[i] of a vector x: [R] -> scalar."""
    return jnp.sum(jnp.where(_iota(x.shape, 0) == i, x, 0))


LEVELS = (8, 4, 2, 1)  # half-widths of the nested pair groups of a 16-row block (ROWS = 16)


def _level_factors(gam, half):
    """Level `half` of the exact diagonal blocks as one anchored product. Rows pair in groups of 2 half (inside
    16-row blocks: gam may be a block's or a whole chunk's): the rows of a group's second half (r) with those of its
    first half (c), through the group's anchor a = its second half's first row: e^(gam_r - gam_a) e^(gam_a - gam_c) =
    e^(gam_r - gam_c), and both factors are <= 1 for any decay (gam does not increase), so no bound is needed.
    Returns (row factors: e^(gam_r - gam_a) on second-half rows, 0 elsewhere; column factors: e^(gam_a - gam_c) on
    first-half rows, 0 elsewhere; the [R, R] mask of same-group pairs).

    The anchor rows are gathered by a one-hot product of bf16 operands (the tensor cores' cheapest; fewer registers
    than fp32 tiles). The product needs no more: a row and a column of one group read the same gathered value
    (identical one-hot rows), so it cancels exactly, and its rounding (|gam| 2^-9) only lets a factor exceed 1 by
    as much."""
    size = gam.shape[0]
    rows = _iota((size, 1), 0)
    second = rows % (2 * half) >= half
    select = (_iota((size, size), 1) == rows // (2 * half) * (2 * half) + half).astype(jnp.bfloat16)
    anchor = lax.dot_general(select, gam.astype(jnp.bfloat16), (((1,), (0,)), ((), ())), preferred_element_type=_F32)
    e = jnp.exp(jnp.where(second, gam - anchor, anchor - gam))
    same = _iota((size, size), 0) // (2 * half) == _iota((size, size), 1) // (2 * half)
    return jnp.where(second, e, 0.0), jnp.where(second, 0.0, e), same


def _diagonal(a):
    """[R, R] -> [R, 1]: its diagonal as a column."""
    eye = _iota(a.shape, 0) == _iota(a.shape, 1)
    return jnp.sum(jnp.where(eye, a, 0.0), axis=1)[:, None]


def pairwise_levels(xs, y, gam):
    """Exact diagonal blocks: [sum_d x[a, d] y[c, d] e^(gam[a, d] - gam[c, d])]_{a >= c, a and c in one 16-row block}
    for each x in xs ([R, K]; y, gam [R, K], gam a cumulative sum of g over the rows). Returns a tuple of [R, R], zero
    above the diagonal and off the diagonal blocks.

    By nested pair groups (_level_factors): every pair a > c of a block belongs to one level (the highest bit in
    which a and c differ), so four masked [R, K] x [K, R] products per x, plus the diagonal a = c (decay 1). The
    column loop it replaced (v8) summed [R, K] tiles across lanes for each of a block's 16 columns: four times the
    exponentials, and 1.7x the time in the forward's score kernel (H100, T = 32768: 6.17 against 3.58 ms,
    benchmarks/results/kda_v9_h100/trace_*_32k*.md)."""
    size = gam.shape[0]
    eye = _iota((size, size), 0) == _iota((size, size), 1)
    out = [jnp.where(eye, jnp.sum(x * y, axis=1)[:, None], 0.0) for x in xs]
    with score_products():
        for half in LEVELS:
            row_f, col_f, same = _level_factors(gam, half)
            yc = y * col_f
            out = [o + jnp.where(same, mm_nt(x * row_f, yc), 0.0) for o, x in zip(out, xs)]
    return tuple(out)


def pairwise_levels_grads(dscores, xs, y, gam):
    """Backward of pairwise_levels: for each (dA [R, R], x), dx [R, K]; and dy [R, K] summed over the pairs. dA's
    diagonal entries count (decay 1); its entries off the diagonal blocks are ignored."""
    dxs = [_diagonal(da) * y for da in dscores]
    dy = sum(_diagonal(da) * x for da, x in zip(dscores, xs))
    with score_products():
        for half in LEVELS:
            row_f, col_f, same = _level_factors(gam, half)
            yc = y * col_f
            dy_level = 0.0
            for i, (da, x) in enumerate(zip(dscores, xs)):
                da = jnp.where(same, da, 0.0)
                dxs[i] = dxs[i] + mm(da, yc) * row_f
                dy_level = dy_level + mm_tn(da, x * row_f)
            dy = dy + dy_level * col_f
    return tuple(dxs), dy


def nilpotent_inverse(n, order):
    """(I - N)^-1 = (I + N)(I + N^2)(I + N^4)... for n: [C, C] with N^order = 0 (order a power of two)."""
    size = n.shape[0]
    eye = (_iota((size, size), 0) == _iota((size, size), 1)).astype(_F32)
    inverse, power, reach = eye + n, n, 2
    while reach < order:
        power = mm(power, power)
        inverse = mm(inverse, eye + power)
        reach *= 2
    return inverse
