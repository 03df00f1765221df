"""The Block AttnRes depth mix as one Pallas (Triton) kernel forward and one backward per site.

    r_s = (mean_d(v_s²) + eps)^(-1/2),  l_s = (v_s · q) r_s,  α = softmax_s(l),  out = Σ_s α_s v_s

for S sources v_s [N, d] (N = B·T tokens) and q = key_norm_scale ⊙ query [d] fp32. Everything per token is
fp32; out and the source gradients are in the sources' dtype (e bytes per element).

HBM traffic per site (the point of the kernels; the XLA version reads each source at least twice forward and
several times more in its autodiff backward, over many small kernels):

- forward: reads each source once, S·N·d·e, and writes out, N·d·e. Nothing else is saved: the backward's
  residuals are the sources themselves, which the model keeps anyway.
- backward: reads each source and dout once, (S + 1)·N·d·e, writes dv_s, S·N·d·e, and a per-program partial
  of dq, P·d·4 bytes for P programs (P ≈ N / backward rows per program, summed in XLA; no atomics). It
  recomputes r_s, l_s and α from the source tiles it loads anyway instead of reading them back: that costs
  two reductions over d per source and saves writing and reading 8·S·N bytes, and a layout of [S, N] blocks
  with S not a power of two.

Backward, per token (g_s = dL/dl_s, dr_s/dv_s = -r_s³ v_s / d):
    dα_s = dout · v_s,  g_s = α_s (dα_s - Σ_t α_t dα_t)
    dv_s = α_s dout + g_s (r_s q - (v_s · q) r_s³ / d · v_s),  dq = Σ_tokens Σ_s g_s r_s v_s

Tiles keep d whole (Triton needs power-of-two block dimensions, so d must be one); rows past N in the last
block are masked on load (as zeros, which give g_s = 0 and so add nothing to dq) and on store.

Forward + backward per site on one H200 (bf16, N = 8192, d = 512, default tuning; `experiments/verify_attn_res.py`,
`benchmarks/results/attn_res_kernel_h200.md`): 54 / 85 / 101 µs at S = 2 / 4 / 6 against XLA's 91 / 155 / 170;
2.3-3.5x the traffic floor.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

_F32 = jnp.float32
# Elements per source tile. Measured on an H200 at d=512, S=4, bf16: 2 rows (1024 elements, 8 per thread with
# 4 warps) beat 1, 4 and 8 rows in both kernels; larger tiles keep more of S tiles live and spill. Other d and
# S were not tuned.
_TILE_ELEMENTS = 1024
_MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch parameters of one kernel. A program loops over `blocks` tiles of `rows` rows (None:
    default_block_rows(d)); the backward's dq partials number N / (rows·blocks)."""

    rows: int | None = None
    blocks: int = 1
    num_warps: int = 4
    num_stages: int = 1


FORWARD = Tuning()
# 8 tiles per program keep the dq partials at 1/8 of a per-tile layout; 2 to 16 timed the same (H200, S=4).
BACKWARD = Tuning(blocks=8)


def is_supported(d: int) -> bool:
    """Whether the kernels take feature size d: a power of two (Triton block shapes), at least 16."""
    return d >= 16 and d & (d - 1) == 0


def default_block_rows(d: int) -> int:
    """Rows per tile: the largest power of two with rows·d ≤ _TILE_ELEMENTS, in [1, _MAX_ROWS]."""
    rows = max(1, _TILE_ELEMENTS // d)
    return min(_MAX_ROWS, 1 << (rows.bit_length() - 1))


def attn_res_mix_fused(sources: Sequence[jax.Array], q: jax.Array, eps: float = 1e-6, *,
                       block_rows: int | None = None, interpret: bool = False) -> jax.Array:
    """Σ_s softmax_s((v_s · q) / rms(v_s)) v_s for S arrays [B, T, d] of one shape and dtype, q [d] fp32.

    Returns [B, T, d] in the sources' dtype. block_rows: rows per tile (a power of two; default from d).
    """
    sources = tuple(sources)
    if not sources:
        raise ValueError("attn_res_mix_fused: sources must hold at least one array, got none")
    shape, dtype = sources[0].shape, sources[0].dtype
    for i, x in enumerate(sources):
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"attn_res_mix_fused: sources[{i}] is {x.dtype}{list(x.shape)}, "
                             f"sources[0] is {dtype}{list(shape)}: all must match")
    d = shape[-1]
    if not is_supported(d):
        raise ValueError(f"attn_res_mix_fused: the feature size d = {d} must be a power of two >= 16")
    if q.shape != (d,):
        raise ValueError(f"attn_res_mix_fused: q must have shape ({d},), got {q.shape}")
    if block_rows is not None and (block_rows < 1 or block_rows & (block_rows - 1)):
        raise ValueError(f"attn_res_mix_fused: block_rows must be a power of two, got {block_rows}")
    flat = tuple(x.reshape(-1, d) for x in sources)  # free reshapes; the sources are never stacked
    out = _mix(flat, q.astype(_F32), float(eps), block_rows, bool(interpret))
    return out.reshape(shape)


def _row_mask(start, rows: int, d: int, n: int) -> jax.Array:
    """[rows, d]: True on rows start.. that lie inside the N = n tokens."""
    return start + lax.broadcasted_iota(jnp.int32, (rows, d), 0) < n


def _mix_tile(q, xs, eps):
    """q [1, d], xs: S fp32 tiles [rows, d] -> (α_s [rows, 1], r_s [rows, 1], (v_s · q) [rows, 1]) lists."""
    d = q.shape[-1]
    dots = [jnp.sum(x * q, axis=-1, keepdims=True) for x in xs]
    inv_rms = [lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / d + eps) for x in xs]
    logits = [dot * r for dot, r in zip(dots, inv_rms)]
    top = functools.reduce(jnp.maximum, logits)
    exps = [jnp.exp(logit - top) for logit in logits]
    total = functools.reduce(jnp.add, exps)
    return [e / total for e in exps], inv_rms, dots


def _fwd_kernel(q_ref, *refs, eps, n, sub_rows):
    *src_refs, out_ref = refs
    rows, d = out_ref.shape
    q = q_ref[...][None, :]
    first = pl.program_id(0) * rows  # read outside the loop: interpret mode only resolves it there

    def block(j, carry):
        mask = _row_mask(first + j * sub_rows, sub_rows, d, n)
        tile = pl.ds(j * sub_rows, sub_rows)
        xs = [pl_triton.load(ref.at[tile, :], mask=mask, other=0.0).astype(_F32) for ref in src_refs]
        alphas, _, _ = _mix_tile(q, xs, eps)
        out = functools.reduce(jnp.add, [a * x for a, x in zip(alphas, xs)])
        pl_triton.store(out_ref.at[tile, :], out.astype(out_ref.dtype), mask=mask)
        return carry

    lax.fori_loop(0, rows // sub_rows, block, 0)


def _bwd_kernel(q_ref, dout_ref, *refs, eps, n, sub_rows):
    num_sources = (len(refs) - 1) // 2
    src_refs, dsrc_refs, dq_ref = refs[:num_sources], refs[num_sources:-1], refs[-1]
    rows, d = dout_ref.shape
    q = q_ref[...][None, :]
    first = pl.program_id(0) * rows

    def block(j, dq):
        mask = _row_mask(first + j * sub_rows, sub_rows, d, n)
        tile = pl.ds(j * sub_rows, sub_rows)
        load = lambda ref: pl_triton.load(ref.at[tile, :], mask=mask, other=0.0).astype(_F32)  # noqa: E731
        dout = load(dout_ref)
        xs = [load(ref) for ref in src_refs]
        alphas, inv_rms, dots = _mix_tile(q, xs, eps)
        dalphas = [jnp.sum(dout * x, axis=-1, keepdims=True) for x in xs]
        mean_dalpha = functools.reduce(jnp.add, [a * da for a, da in zip(alphas, dalphas)])
        for x, a, r, dot, da, ref in zip(xs, alphas, inv_rms, dots, dalphas, dsrc_refs):
            gr = a * (da - mean_dalpha) * r  # dL/dlogit · r
            dx = a * dout + gr * q - (gr * dot * r * r / d) * x
            pl_triton.store(ref.at[tile, :], dx.astype(ref.dtype), mask=mask)
            dq = dq + jnp.sum(gr * x, axis=0)
        return dq

    dq_ref[...] = lax.fori_loop(0, rows // sub_rows, block, jnp.zeros((d,), _F32))


def _launch(kernel, tuning: Tuning, n: int, d: int, block_rows: int | None, interpret: bool, **kw):
    """(pallas_call over the row blocks, program count, the row-tile BlockSpec) for one kernel."""
    sub_rows = block_rows or tuning.rows or default_block_rows(d)
    # No more tiles per program than there are tiles, so small N does not run mostly masked loops.
    rows = sub_rows * min(tuning.blocks, pl.cdiv(n, sub_rows))
    programs = pl.cdiv(n, rows)

    def call(in_specs, out_specs, out_shape, name):
        return pl.pallas_call(
            functools.partial(kernel, n=n, sub_rows=sub_rows, **kw), grid=(programs,), in_specs=in_specs,
            out_specs=out_specs, out_shape=out_shape, interpret=interpret, name=name,
            compiler_params=pl_triton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages))

    return call, programs, pl.BlockSpec((rows, d), lambda i: (i, 0))


def _fwd_call(sources, q, eps, block_rows, interpret):
    n, d = sources[0].shape
    call, _, tile = _launch(_fwd_kernel, FORWARD, n, d, block_rows, interpret, eps=eps)
    vector = pl.BlockSpec((d,), lambda i: (0,))
    return call([vector] + [tile] * len(sources), tile, jax.ShapeDtypeStruct((n, d), sources[0].dtype),
                "attn_res_mix_fwd")(q, *sources)


def _bwd_call(sources, q, dout, eps, block_rows, interpret):
    n, d = sources[0].shape
    num_sources = len(sources)
    call, programs, tile = _launch(_bwd_kernel, BACKWARD, n, d, block_rows, interpret, eps=eps)
    vector = pl.BlockSpec((d,), lambda i: (0,))
    *dsources, dq_parts = call(
        [vector] + [tile] * (num_sources + 1),
        [tile] * num_sources + [pl.BlockSpec((None, d), lambda i: (i, 0))],
        [jax.ShapeDtypeStruct((n, d), sources[0].dtype)] * num_sources
        + [jax.ShapeDtypeStruct((programs, d), _F32)],
        "attn_res_mix_bwd")(q, dout, *sources)
    return tuple(dsources), jnp.sum(dq_parts, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _mix(sources, q, eps, block_rows, interpret):
    return _fwd_call(sources, q, eps, block_rows, interpret)


def _mix_fwd(sources, q, eps, block_rows, interpret):
    return _fwd_call(sources, q, eps, block_rows, interpret), (sources, q)


def _mix_bwd(eps, block_rows, interpret, residuals, dout):
    sources, q = residuals
    return _bwd_call(sources, q, dout, eps, block_rows, interpret)


_mix.defvjp(_mix_fwd, _mix_bwd)
