"""The fused AttnRes mix (pallas_kernels.attn_res) in interpret mode against the XLA attn_res_mix.

N = B·T = 74 tokens is not a multiple of any block size used, so every run has a masked last block;
block_rows=4 also gives the backward several programs, each looping over several row blocks.
The Triton lowering itself only runs on a GPU and is not exercised here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.layers import attn_res
from hybridmoe.layers.attn_res import attn_res_mix
from pallas_kernels.attn_res import attn_res_mix_fused, default_block_rows

B, T, D = 2, 37, 64


def _inputs(s: int, dtype, seed: int):
    """S sources [B, T, D] of different scales (so the RMS matters), query, key scale, cotangent."""
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.standard_normal(s))
    sources = [jnp.asarray(rng.standard_normal((B, T, D)) * c, dtype) for c in scales]
    query = jnp.asarray(rng.standard_normal(D), jnp.float32)
    scale = jnp.asarray(1.0 + 0.5 * rng.standard_normal(D), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    return sources, query, scale, cot


@functools.partial(jax.jit, static_argnames=("impl", "block_rows"))
def _value_and_grads(sources, query, scale, cot, *, impl, block_rows=None):
    """(out, d/d(sources, query, scale) of Σ out·cot) through attn_res_mix or the fused op."""
    def mix(sources, query, scale):
        if block_rows is None:
            return attn_res_mix(sources, query, scale, impl=impl)
        return attn_res_mix_fused(sources, scale * query, 1e-6, block_rows=block_rows,
                                  interpret=True)

    def loss(*args):
        out = mix(*args)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(sources, query, scale)
    return out, grads


def _f32(x):
    return np.asarray(x, np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("s, block_rows", [(2, None), (3, 16), (5, 4)])
def test_fused_matches_xla_values_and_gradients(s, block_rows, dtype):
    sources, query, scale, cot = _inputs(s, dtype, seed=s)
    want_out, (want_src, want_q, want_scale) = _value_and_grads(sources, query, scale, cot,
                                                                impl="xla")
    got_out, (got_src, got_q, got_scale) = _value_and_grads(
        sources, query, scale, cot, impl="interpret", block_rows=block_rows)
    assert got_out.dtype == dtype and all(g.dtype == dtype for g in got_src)
    # bf16: both sides compute in fp32 and round once; a different fp32 summation order may move a
    # value across a bf16 rounding boundary, one ulp (2^-8 relative).
    rtol, atol = (1e-5, 1e-5) if dtype == jnp.float32 else (8e-3, 1e-2)
    np.testing.assert_allclose(_f32(got_out), _f32(want_out), rtol=rtol, atol=atol)
    for got, want in zip(got_src, want_src):
        np.testing.assert_allclose(_f32(got), _f32(want), rtol=rtol, atol=atol)
    # Parameter gradients are fp32 sums over all tokens on both sides.
    for got, want in ((got_q, want_q), (got_scale, want_scale)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("s", [2, 4])
def test_zero_query_is_plain_mean(s):
    sources, _, scale, _ = _inputs(s, jnp.float32, seed=10 + s)
    out = attn_res_mix(sources, jnp.zeros(D), scale, impl="interpret")
    # softmax of equal logits is 1/s, a power of two here: the mean, bit for bit
    np.testing.assert_array_equal(out, jnp.mean(jnp.stack(sources), axis=0))


def test_stacked_sources_and_rank3_layout():
    sources, query, scale, _ = _inputs(3, jnp.float32, seed=20)
    stacked = attn_res_mix(jnp.stack(sources), query, scale, impl="interpret")
    np.testing.assert_array_equal(stacked, attn_res_mix(sources, query, scale, impl="interpret"))


def test_impl_is_validated():
    sources, query, scale, _ = _inputs(2, jnp.float32, seed=30)
    with pytest.raises(ValueError, match=r"attn_res_mix.impl must be one of 'auto'.*got 'triton'"):
        attn_res_mix(sources, query, scale, impl="triton")
    odd = [x[..., :48] for x in sources]  # d = 48: no power-of-two Triton block
    with pytest.raises(ValueError, match="d = 48 must be a power of two"):
        attn_res_mix(odd, query[:48], scale[:48], impl="pallas")


def test_auto_picks_fused_only_on_gpu_for_supported_shapes(monkeypatch):
    assert not attn_res._fused("auto", d=D, num_sources=3)  # these tests run on the CPU
    assert attn_res._fused("interpret", d=D, num_sources=3)
    assert not attn_res._fused("xla", d=D, num_sources=3)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attn_res._fused("auto", d=512, num_sources=2)
    assert not attn_res._fused("auto", d=48, num_sources=3)  # not a power of two: XLA
    assert not attn_res._fused("auto", d=8, num_sources=3)  # below a useful tile
    assert not attn_res._fused("auto", d=512, num_sources=1)


def test_default_block_rows_are_powers_of_two_within_the_tile_budget():
    for d in (16, 64, 512, 2048, 8192):
        rows = default_block_rows(d)
        assert rows >= 1 and rows & (rows - 1) == 0 and rows <= 64
        assert rows == 1 or rows * d <= 1024
