"""Sub-chunk tiling of the chunked KDA algorithm: which diagonal path runs for a given decay bound."""

import numbers

from pallas_kernels.kda.gates import check_g_min

# fp32 exp overflows just above 88.72; stay below with a margin.
EXP_LIMIT = 88.0
# Candidate dense sub-chunk heights, largest first: bigger tiles mean fewer, larger matmuls.
DENSE_ROWS = (64, 32, 16, 8)
# Sub-chunk height of the pairwise diagonal (its rank-4 decay tensor costs C * R * K per chunk).
PAIRWISE_ROWS = 16
CHUNK_SIZE_RANGE = (8, 256)


def check_chunk_size(chunk_size):
    """Raises ValueError unless chunk_size is a power of two in [8, 256] (the product-form inverse needs 2^m rows)."""
    low, high = CHUNK_SIZE_RANGE
    ok = isinstance(chunk_size, numbers.Integral) and not isinstance(chunk_size, bool) and low <= chunk_size <= high
    if not ok or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two in [{low}, {high}], got {chunk_size!r}")


def kda_diagonal_path(g_min, chunk_size):
    """Returns ("dense", R) or ("pairwise", R): how the diagonal sub-chunk blocks of a chunk are computed.

    Dense: each R-row block is one matmul anchored at the block's row 0, whose largest exponent is (R - 1) * |g_min|;
    the largest R dividing chunk_size that keeps it under EXP_LIMIT wins. Without a bound (g_min=None), or when even
    R = 8 would overflow, the diagonal blocks use exact pairwise decay differences instead.
    """
    check_chunk_size(chunk_size)
    pairwise = ("pairwise", min(PAIRWISE_ROWS, chunk_size))
    if g_min is None:
        return pairwise
    check_g_min(g_min)
    for rows in DENSE_ROWS:
        if chunk_size % rows == 0 and (rows - 1) * -g_min < EXP_LIMIT:
            return ("dense", rows)
    return pairwise
