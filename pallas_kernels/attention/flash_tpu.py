"""Causal flash attention over packed documents for Mosaic TPU, every mask derived from indices.

Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) describes its mask by tables built on the
host, one entry per (query block, key block) pair: (T / 512)^2 of them, which at T = 262144 take minutes to build
and at T = 1M do not fit the core's scalar memory. Here the causal mask is computed from the program ids and the
document mask from the segment ids, in the kernel; the only tables are two per block, computed on the device:

  first_kv[i]  the first key block that shares a document with query block i (blocks before it are skipped),
  last_q[j]    the last query block that shares a document with key block j.

So a row of packed documents costs the blocks inside each document's causal triangle, not the whole row's. A pair
"shares a document" when the blocks' id ranges overlap, which is exact for ids that never decrease along the row
(packing writes them so) and a superset otherwise; the in-kernel mask keeps any order of ids correct.

Three kernels (forward; key/value gradients; query gradients), grids (batch, head, block, block) with the last
axis sequential. The grid spans every block pair; a skipped step repeats its block indices (no copy) and runs no
vector work, but still costs a grid step, which at 1M tokens and 512-row tiles is half of the 4M steps per head. Query/key width may differ from the value width (MLA: 192 / 128). Pallas' TPU interpreter runs
them on any platform (the CPU tests); on a TPU they have been lowered (experiments/lower_attention_tpu.py), not
compiled by libtpu or timed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES, SUBLANES = 128, 8
_F32 = jnp.float32
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def block_tables(ids: jax.Array, tile: int) -> tuple[jax.Array, jax.Array]:
    """ids: [B, Tp] (Tp a multiple of tile) -> first_kv, last_q: [B * Tp / tile] int32 (batch-major)."""
    batch, length = ids.shape
    blocks = ids.reshape(batch, length // tile, tile)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    n = length // tile
    meet = (low[:, :, None] <= high[:, None, :]) & (low[:, None, :] <= high[:, :, None])  # [B, query, key]
    meet &= jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
    first_kv = jnp.argmax(meet, axis=2)  # the diagonal always meets: a block is never empty
    last_q = n - 1 - jnp.argmax(meet[:, ::-1, :], axis=1)
    return first_kv.reshape(-1).astype(jnp.int32), last_q.reshape(-1).astype(jnp.int32)


def _lanes(x, width):
    """A [rows, LANES] lane-replicated array widened or narrowed to [rows, width]."""
    if width % LANES == 0:
        return jnp.tile(x, (1, width // LANES))
    if width < LANES:
        return x[:, :width]
    raise ValueError(f"flash attention: a width of {width} is neither below nor a multiple of {LANES}")


def _mask(q_ids, kv_ids, q_block, kv_block, shape, *, transposed=False):
    """Same document and causal. Not transposed: rows are queries ([tq, 1] ids), columns keys ([1, tk]);
    transposed: rows are keys ([tk, 1]), columns queries ([1, tq])."""
    rows = lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = lax.broadcasted_iota(jnp.int32, shape, 1)
    if transposed:
        causal = kv_block * shape[0] + rows <= q_block * shape[1] + cols
    else:
        causal = q_block * shape[0] + rows >= kv_block * shape[1] + cols
    return causal & (q_ids == kv_ids)


def _forward_kernel(first_ref, last_ref, ids_q_ref, ids_kv_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                    m_ref, l_ref, acc_ref, *, scale, blocks):
    del last_ref
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, _MASKED)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((j >= first_ref[b * blocks + i]) & (j <= i))
    def _():
        s = lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=_F32) * scale  # [tq, tk]
        q_ids = jnp.expand_dims(ids_q_ref[0], -1)
        s = jnp.where(_mask(q_ids, ids_kv_ref[:1, :], i, j, s.shape), s, _MASKED)
        m_prev, l_prev = m_ref[...], l_ref[...]  # [tq, LANES], lane-replicated
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
        p = jnp.exp(s - _lanes(m_next, s.shape[1]))
        alpha = jnp.exp(m_prev - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1)[:, None]
        v = v_ref[...]
        acc_ref[...] = (acc_ref[...] * _lanes(alpha, acc_ref.shape[1])
                        + lax.dot_general(p.astype(v.dtype), v, _NN, preferred_element_type=_F32))

    @pl.when(j == i)  # the diagonal block is every query block's last
    def _():
        l = l_ref[...]
        o_ref[...] = (acc_ref[...] / _lanes(l, acc_ref.shape[1])).astype(o_ref.dtype)
        lse_ref[...] = (m_ref[...] + jnp.log(l)).T[:SUBLANES]  # stored as rows [SUBLANES, tq]


def _dkv_kernel(first_ref, last_ref, ids_q_ref, ids_kv_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref,
                dk_ref, dv_ref, dk_acc, dv_acc, *, scale, blocks):
    """Key block j (program axis 2) against query blocks i in [j, last_q[j]] (axis 3), transposed scores."""
    del first_ref
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    last = last_ref[b * blocks + j]

    @pl.when(i == 0)
    def _():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    @pl.when((i >= j) & (i <= last))
    def _():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = lax.dot_general(k, q, _NT, preferred_element_type=_F32) * scale  # [tk, tq]
        kv_ids = jnp.expand_dims(ids_kv_ref[0], -1)
        p = jnp.where(_mask(ids_q_ref[:1, :], kv_ids, i, j, s.shape, transposed=True),
                      jnp.exp(s - lse_ref[:1, :]), 0.0)
        dv_acc[...] += lax.dot_general(p.astype(do.dtype), do, _NN, preferred_element_type=_F32)
        dp = lax.dot_general(v, do, _NT, preferred_element_type=_F32)  # [tk, tq]
        ds = p * (dp - di_ref[:1, :])
        dk_acc[...] += lax.dot_general(ds.astype(q.dtype), q, _NN, preferred_element_type=_F32)

    @pl.when(i == last)
    def _():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(first_ref, last_ref, ids_q_ref, ids_kv_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref,
               dq_ref, dq_acc, *, scale, blocks):
    del last_ref
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    @pl.when((j >= first_ref[b * blocks + i]) & (j <= i))
    def _():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = lax.dot_general(q, k, _NT, preferred_element_type=_F32) * scale  # [tq, tk]
        q_ids = jnp.expand_dims(ids_q_ref[0], -1)
        p = jnp.where(_mask(q_ids, ids_kv_ref[:1, :], i, j, s.shape),
                      jnp.exp(s - jnp.expand_dims(lse_ref[0], -1)), 0.0)
        dp = lax.dot_general(do, v, _NT, preferred_element_type=_F32)
        ds = p * (dp - jnp.expand_dims(di_ref[0], -1))
        dq_acc[...] += lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=_F32)

    @pl.when(j == i)
    def _():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


class _Specs:
    """Block specs for grids (batch, head, outer block, inner block); `rows_outer`: the outer axis walks
    query blocks (forward, dq), else key blocks (dkv). Prefetched tables arrive as the last two index-map
    arguments; skipped steps repeat the previous block index, so their copies are elided."""

    def __init__(self, tile, blocks, rows_outer):
        self.tile, self.blocks, self.rows_outer = tile, blocks, rows_outer

    def _blocks(self, b, o, n, first, last):
        if self.rows_outer:  # o: query block, n: key block in [first_kv[o], o]
            return o, jnp.clip(n, first[b * self.blocks + o], o)
        return jnp.clip(n, o, last[b * self.blocks + o]), o  # o: key block, n: query block in [o, last_q[o]]

    def rows(self, width, on_query):
        """[B, H, Tp, width] tiles of the query side or the key side."""
        def index(b, h, o, n, first, last):
            qb, kb = self._blocks(b, o, n, first, last)
            return b, h, qb if on_query else kb, 0
        return pl.BlockSpec((None, None, self.tile, width), index)

    def ids(self, on_query):
        """[B, SUBLANES, Tp] sublane-replicated segment ids."""
        def index(b, h, o, n, first, last):
            qb, kb = self._blocks(b, o, n, first, last)
            return b, 0, qb if on_query else kb
        return pl.BlockSpec((None, SUBLANES, self.tile), index)

    def per_query(self):
        """[B, H, SUBLANES, Tp] sublane-replicated per-query scalars (log-sum-exp, rowsum(o * do))."""
        def index(b, h, o, n, first, last):
            qb, _ = self._blocks(b, o, n, first, last)
            return b, h, 0, qb
        return pl.BlockSpec((None, None, SUBLANES, self.tile), index)

    def outer(self, width):
        return pl.BlockSpec((None, None, self.tile, width), lambda b, h, o, n, first, last: (b, h, o, 0))


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _call(kernel, specs, in_specs, out_specs, out_shape, scratch, grid, tables, *args, interpret, name):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=grid, in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=_params(),
        interpret=interpret,
        name=name,
    )(*tables, *args)


def _forward(q, k, v, ids, tables, scale, tile, interpret):
    batch, heads, length, dqk = q.shape
    dv = v.shape[-1]
    blocks = length // tile
    s = _Specs(tile, blocks, rows_outer=True)
    o, lse = _call(
        functools.partial(_forward_kernel, scale=scale, blocks=blocks), s,
        [s.ids(True), s.ids(False), s.rows(dqk, True), s.rows(dqk, False), s.rows(dv, False)],
        [s.outer(dv), s.per_query()],
        [jax.ShapeDtypeStruct((batch, heads, length, dv), v.dtype),
         jax.ShapeDtypeStruct((batch, heads, SUBLANES, length), _F32)],
        [pltpu.VMEM((tile, LANES), _F32), pltpu.VMEM((tile, LANES), _F32), pltpu.VMEM((tile, dv), _F32)],
        (batch, heads, blocks, blocks), tables, ids, ids, q, k, v, interpret=interpret, name="mla_flash_fwd")
    return o, lse


def _backward(q, k, v, ids, tables, o, lse, do, scale, tile, interpret):
    batch, heads, length, dqk = q.shape
    dv = v.shape[-1]
    blocks = length // tile
    grid = (batch, heads, blocks, blocks)
    di = jnp.sum(o.astype(_F32) * do.astype(_F32), axis=-1)
    per_query = lambda x: jnp.broadcast_to(x[:, :, None, :], (batch, heads, SUBLANES, length))  # noqa: E731
    args = (ids, ids, q, k, v, do, per_query(lse), per_query(di))

    kv = _Specs(tile, blocks, rows_outer=False)
    dk, dv_ = _call(
        functools.partial(_dkv_kernel, scale=scale, blocks=blocks), kv,
        [kv.ids(True), kv.ids(False), kv.rows(dqk, True), kv.rows(dqk, False), kv.rows(dv, False),
         kv.rows(dv, True), kv.per_query(), kv.per_query()],
        [kv.outer(dqk), kv.outer(dv)],
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        [pltpu.VMEM((tile, dqk), _F32), pltpu.VMEM((tile, dv), _F32)],
        grid, tables, *args, interpret=interpret, name="mla_flash_dkv")

    qs = _Specs(tile, blocks, rows_outer=True)
    dq = _call(
        functools.partial(_dq_kernel, scale=scale, blocks=blocks), qs,
        [qs.ids(True), qs.ids(False), qs.rows(dqk, True), qs.rows(dqk, False), qs.rows(dv, False),
         qs.rows(dv, True), qs.per_query(), qs.per_query()],
        qs.outer(dqk), jax.ShapeDtypeStruct(q.shape, q.dtype), [pltpu.VMEM((tile, dqk), _F32)],
        grid, tables, *args, interpret=interpret, name="mla_flash_dq")
    return dq, dk, dv_


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, ids, scale, tile, interpret):
    return _forward(q, k, v, ids, block_tables(ids[:, 0], tile), scale, tile, interpret)[0]


def _attention_fwd(q, k, v, ids, scale, tile, interpret):
    tables = block_tables(ids[:, 0], tile)
    o, lse = _forward(q, k, v, ids, tables, scale, tile, interpret)
    return o, (q, k, v, ids, tables, o, lse[:, :, 0])


def _attention_bwd(scale, tile, interpret, res, do):
    q, k, v, ids, tables, o, lse = res
    dq, dk, dv = _backward(q, k, v, ids, tables, o, lse, do, scale, tile, interpret)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def default_tile(length: int, largest: int = 512) -> tuple[int, int]:
    """(padded length, tile): the length rounded up to 128 and the largest power-of-two tile <= `largest`
    dividing it."""
    padded = -(-length // LANES) * LANES
    tile = max(b for b in (128, 256, 512, 1024) if b <= max(largest, LANES) and padded % b == 0)
    return padded, tile


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, scale: float, *,
                    tile: int | None = None, interpret: bool = False) -> jax.Array:
    """Causal attention inside each document; `hybridmoe.layers.mla.xla_attention`'s signature.

    q, k: [B, T, H, Dqk], v: [B, T, H, Dv]; segment_ids [B, T] or None -> [B, T, H, Dv] in v's dtype. Dv must be
    below 128 or a multiple of it. `tile`: query/key block rows (a multiple of 128 dividing the padded length;
    default the largest of 128..512 that does).
    """
    batch, length, heads, _ = q.shape
    if k.shape[:3] != (batch, length, heads) or v.shape[:3] != (batch, length, heads):
        raise ValueError(f"flash_attention: q {q.shape}, k {k.shape} and v {v.shape} must share batch, length "
                         "and heads (self-attention over one sequence)")
    padded, auto_tile = default_tile(length)
    tile = auto_tile if tile is None else tile
    if tile % LANES or padded % tile:
        raise ValueError(f"flash_attention: tile={tile} must be a multiple of {LANES} dividing the padded "
                         f"length {padded}")
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, length), jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    pad = padded - length
    # Padding forms one more document after the row's last id: the ids stay non-decreasing where they were,
    # every padded query sees at least itself, and no real query sees padding.
    fresh = jnp.max(segment_ids, axis=1, keepdims=True) + 1
    ids = jnp.concatenate([segment_ids, jnp.broadcast_to(fresh, (batch, pad))], axis=1) if pad else segment_ids
    ids = jnp.broadcast_to(ids[:, None, :], (batch, SUBLANES, padded))
    heads_first = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0)))  # noqa: E731
    out = _attention(heads_first(q), heads_first(k), heads_first(v), ids, float(scale), tile, interpret)
    return jnp.swapaxes(out[:, :, :length], 1, 2)
