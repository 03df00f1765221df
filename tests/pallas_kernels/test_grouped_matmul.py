"""grouped_matmul (pallas_kernels.moe) on the CPU: the reference path through the custom VJP against a dense
per-group loop (values and gradients), the Mosaic kernel's tile table against the stock kernel's own group
lookup, the Mosaic GPU path lowered for CUDA from this host, and dispatch_grouped against the dropless
capacity path. The kernels themselves run on the H200 (experiments/bench_moe.py checks them there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import GroupedMatmulConfig, grouped_matmul, grouped_matmul_dense_reference, tile_table

REF = GroupedMatmulConfig(backend="reference")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _inputs(seed, m, k, n, sizes, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    r = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), r


# Empty groups (first, middle, last), one group larger than the rest, and 3 tail rows in no group.
SIZES = [0, 7, 13, 0, 1, 20, 9, 0]
M = sum(SIZES) + 3


def test_reference_values_match_dense_loop():
    x, w, gs, _ = _inputs(0, M, 24, 16, SIZES)
    out = jax.jit(lambda x, w, gs: grouped_matmul(x, w, gs, config=REF))(x, w, gs)
    ref = jax.jit(lambda x, w: grouped_matmul_dense_reference(x, w, SIZES))(x, w)
    assert out.shape == (M, 16) and out.dtype == x.dtype
    assert _rel(out, ref) < 1e-5
    assert np.all(np.asarray(out[sum(SIZES):]) == 0)  # rows in no group are zero


def test_reference_gradients_match_dense_loop():
    x, w, gs, r = _inputs(1, M, 24, 16, SIZES)
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w) * r))
    dx, dw = jax.jit(jax.grad(loss(lambda x, w: grouped_matmul(x, w, gs, config=REF)), (0, 1)))(x, w)
    rdx, rdw = jax.jit(jax.grad(loss(lambda x, w: grouped_matmul_dense_reference(x, w, SIZES)), (0, 1)))(x, w)
    assert _rel(dx, rdx) < 1e-5 and _rel(dw, rdw) < 1e-5
    assert np.all(np.asarray(dx[sum(SIZES):]) == 0)
    assert np.all(np.asarray(dw[0]) == 0) and np.all(np.asarray(dw[3]) == 0)  # empty groups: no gradient


def test_reference_bf16_and_weight_dtype():
    x, w, gs, r = _inputs(2, M, 32, 16, SIZES, jnp.bfloat16)
    w32 = w.astype(jnp.float32)
    f = lambda w: grouped_matmul(x, w, gs, config=REF)  # w cast to x's dtype
    ref = lambda w: grouped_matmul_dense_reference(x, w, SIZES)
    out, dw = jax.jit(lambda w: (f(w), jax.grad(lambda w: jnp.sum(f(w).astype(jnp.float32) * r))(w)))(w32)
    assert out.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    assert _rel(out, ref(w32)) < 1e-2
    rdw = jax.jit(jax.grad(lambda w: jnp.sum(ref(w) * r)))(w32)
    assert _rel(dw, rdw) < 1e-2


@pytest.mark.parametrize("block_m, sizes", [(4, SIZES), (192, [300, 0, 1, 250, 1024, 0])])
def test_tile_table_matches_stock_group_lookup(block_m, sizes):
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import GroupInfo
    m = sum(sizes) + 5
    gs = jnp.asarray(sizes, jnp.int32)
    table = [np.asarray(a) for a in tile_table(gs, block_m, m)]
    num_tiles = -(-m // block_m) + len(sizes) - 1
    assert all(a.shape == (num_tiles,) for a in table)
    def stock(tid):
        info = GroupInfo.create(gs, block_m, tid)
        return info.group_id, info.block, info.actual_start, info.actual_size

    group_id, block, actual_start, actual_size = (np.asarray(a) for a in
                                                  jax.jit(jax.vmap(stock))(jnp.arange(num_tiles)))
    np.testing.assert_array_equal(table[0], group_id)
    np.testing.assert_array_equal(table[1], block)
    lo = np.maximum(table[2], table[1] * block_m)
    hi = np.minimum(table[3], table[1] * block_m + block_m)
    np.testing.assert_array_equal(lo, actual_start)
    np.testing.assert_array_equal(hi - lo, actual_size)
    covered = np.zeros(m, np.int32)
    for a, b in zip(lo, hi):
        covered[a:b] += 1
    assert np.all(covered[:sum(sizes)] == 1) and np.all(covered[sum(sizes):] == 0)


@pytest.mark.parametrize("lookup", ["table", "unrolled"])
def test_mosaic_path_lowers_for_cuda(lookup, monkeypatch):
    """Forward and backward of the Mosaic GPU path lower to CUDA custom calls on this CPU host."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as tmod

    class _Hopper:  # the stock dw kernel asks the first device for its SM count
        core_count = 132

    class _Jax:  # the module's `jax`, with devices() answering a GPU
        def __getattr__(self, name):
            return (lambda *a, **kw: [_Hopper()]) if name == "devices" else getattr(jax, name)

    monkeypatch.setattr(tmod, "jax", _Jax())
    cfg = GroupedMatmulConfig(backend="mosaic_gpu", group_lookup=lookup)
    x = jax.ShapeDtypeStruct((850, 256), jnp.bfloat16)  # rows not a multiple of 8: padded inside
    w = jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((4,), jnp.int32)

    def loss(x, w, gs):
        return jnp.sum(grouped_matmul(x, w, gs, config=cfg).astype(jnp.float32))

    text = jax.jit(jax.grad(loss, (0, 1))).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 3  # forward, dx, dw


def test_dispatch_grouped_matches_dropless():
    from hybridmoe.layers.moe import ExpertWeights, dispatch_dropless, dispatch_grouped
    rng = np.random.default_rng(3)
    n, d, f, e, k = 40, 16, 8, 6, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    mask = jnp.asarray(rng.random((n, k)) > 0.2)  # some inactive slots
    combine = jnp.asarray(rng.random((n, k)), jnp.float32) * mask
    w = ExpertWeights(*(jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32)
                        for s in [(e, d, f), (e, d, f), (e, f, d)]))
    r = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, ids, combine, mask, w, activation="swiglu", capacity=None)[0] * r)

    cfg = GroupedMatmulConfig(backend="reference")
    grouped = lambda *a, **kw: dispatch_grouped(*a, **kw, grouped_config=cfg)
    (lg, (gx, gw)), (ld, (dx, dw)) = (jax.jit(jax.value_and_grad(loss(fn), (0, 1)))(x, w)
                                      for fn in (grouped, dispatch_dropless))
    assert abs(float(lg) - float(ld)) < 1e-4 * max(1.0, abs(float(ld)))
    assert _rel(gx, dx) < 1e-5
    for a, b in zip(gw, dw):
        assert _rel(a, b) < 1e-5
    with pytest.raises(ValueError):
        dispatch_grouped(x, ids, combine, mask, w, activation="swiglu", capacity=4)
