"""The KDA kernels for Mosaic TPU: the per-chunk algebra of pallas_chunk.py (the same functions the GPU kernels run)
with the state recurrences as a sequential grid axis.

Layout: chunk-major, head-major arrays [B, H, N, C, D]; every block is one whole [C, D], [C, C] or [K, V] tile, so the
last two block dims equal the array's and the tiling is legal for Mosaic TPU at any C and D. Per-row vectors are
[.., C, 1] columns (beta, the document index), the document index also a [.., 1, C] row (for the [C, C] masks),
the per-channel decay of a chunk a [.., 1, K] row or [.., K, 1] column: no rank-1 values in a kernel. Prefix sums are
triangular matmuls (blk.matmul_scans).

Kernels (grid (B, HV, N) each): intra forward (parallel), forward state scan (N "arbitrary", the fp32 state in a VMEM
scratch; writes o, the final state and, for the backward, each chunk's incoming state and v_new), reverse state scan
(N "arbitrary", last chunk first), state-side gradients, score gradients and input gradients (parallel).

Verified on the CPU: the interpret-mode tests (tests/pallas_kernels/test_kda_tpu.py) and the lowering to Mosaic TPU
for a TPU target (experiments/lower_kda_tpu.py). Not yet compiled by a TPU's compiler nor run on a TPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import pallas_blocks as blk
from pallas_kernels.kda.layout import document_index
from pallas_kernels.kda.pallas_blocks import ROWS
from pallas_kernels.kda.pallas_chunk import (backward_inputs, backward_scores, chunk_core, chunk_forward, chunk_gates,
                                            k_base)
from pallas_kernels.kda.pallas_fwd import ref_chunk

_F32 = jnp.float32
_PARALLEL = ("parallel", "parallel", "parallel")
_SCAN = ("parallel", "parallel", "arbitrary")


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    dense: bool
    interpret: bool
    # Matmuls of fp32 operands: HIGHEST (fp32 on the MXU) for fp32 inputs, HIGH (three bf16 passes) for bf16 inputs.
    precision: object
    # The scans multiply with the state rounded to the stored intermediates' dtype (as Tuning.scan_low_precision).
    low: bool


def _body(kernel):
    """A kernel body traced for Mosaic TPU: matmul precision and matmul prefix sums."""

    @functools.wraps(kernel)
    def body(*refs, precision, **kw):
        with blk.matmul_precision(precision), blk.matmul_scans():
            kernel(*refs, **kw)

    return body


def _call(kernel, cfg, *, grid, in_specs, out_specs, out_shape, scan=False, scratch=(), name, **kw):
    return pl.pallas_call(
        functools.partial(kernel, precision=cfg.precision, **kw),
        grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=list(scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=_SCAN if scan else _PARALLEL),
        interpret=pltpu.InterpretParams() if cfg.interpret else False, name=name)


# BlockSpecs for grid (b, h, n). group = HV // H for the q/k heads; reverse: chunk N-1-n at step n.
def _tile(rows, cols, *, group=1, reverse_of=None):
    def index(b, h, n):
        return (b, h // group, n if reverse_of is None else reverse_of - 1 - n, 0, 0)
    return pl.BlockSpec((None, None, None, rows, cols), index)


def _doc_tile(rows, cols):
    return pl.BlockSpec((None, None, rows, cols), lambda b, h, n: (b, n, 0, 0))


def _head_state(key_dim, value_dim):
    return pl.BlockSpec((None, None, key_dim, value_dim), lambda b, h, n: (b, h, 0, 0))


def _chunk_in(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, doc_row_ref, doc_in_ref, *, scale):
    """A ChunkIn of a kernel's whole tiles (v_ref may be None), in the [C, 1] / [1, C] / [1, 1] document layout."""
    return ref_chunk(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, doc_in_ref, scale=scale, doc_row_ref=doc_row_ref)


@_body
def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, doc_row_ref, doc_in_ref, w_ref, qp_ref, kd_ref,
                  u_ref, ol_ref, d_ref, *score_refs, scale, dense):
    x = _chunk_in(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, doc_row_ref, doc_in_ref, scale=scale)
    core = chunk_core(x, dense=dense)
    out = chunk_forward(x, core)
    for name, ref in dict(w=w_ref, qp=qp_ref, kd=kd_ref, u=u_ref, ol=ol_ref, d=d_ref).items():
        ref[...] = out[name].astype(ref.dtype)
    for ref, value in zip(score_refs, (core.aqk, core.akk, core.t)):
        ref[...] = value


def _input_specs(inputs, group):
    q, _, v, _, _, doc, _, _ = inputs
    chunk, key_dim, value_dim = q.shape[3], q.shape[4], v.shape[4]
    return [_tile(chunk, key_dim, group=group)] * 2 + [_tile(chunk, value_dim), _tile(chunk, key_dim),
                                                         _tile(chunk, 1), _doc_tile(chunk, 1), _doc_tile(1, chunk),
                                                         _doc_tile(1, 1)]


def intra_forward(cfg, inputs, *, store_dtype, save_scores):
    """inputs: (q, k [B, H, N, C, K], v [B, HV, N, C, V], g [B, HV, N, C, K] fp32, beta [B, HV, N, C, 1],
    doc [B, N, C, 1], doc_row [B, N, 1, C], doc_in [B, N, 1, 1]). Returns w, qp, kd [B, HV, N, C, K], u, ol
    [B, HV, N, C, V] in store_dtype, d [B, HV, N, 1, K] fp32 and, if save_scores, Aqk, Akk, T [B, HV, N, C, C]."""
    q, v = inputs[0], inputs[2]
    batch, heads, chunks, chunk, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[4]
    shape = lambda d, dtype=store_dtype: jax.ShapeDtypeStruct((batch, value_heads, chunks, chunk, d), dtype)  # noqa
    out_shape = [shape(key_dim)] * 3 + [shape(value_dim)] * 2 + [
        jax.ShapeDtypeStruct((batch, value_heads, chunks, 1, key_dim), _F32)]
    out_specs = [_tile(chunk, key_dim)] * 3 + [_tile(chunk, value_dim)] * 2 + [_tile(1, key_dim)]
    if save_scores:
        out_shape += [shape(chunk, _F32)] * 3
        out_specs += [_tile(chunk, chunk)] * 3
    return _call(_intra_kernel, cfg, grid=(batch, value_heads, chunks),
                 in_specs=_input_specs(inputs, value_heads // heads), out_specs=out_specs, out_shape=out_shape,
                 name="kda_tpu_intra_fwd", scale=cfg.scale, dense=cfg.dense)(*inputs)


def _operand(low, x, like):
    return x.astype(like.dtype) if low else x


def _load(low, ref):
    return ref[...] if low else ref[...].astype(_F32)


@_body
def _scan_kernel(w_ref, qp_ref, kd_ref, u_ref, ol_ref, d_ref, s_init_ref, o_ref, s_out_ref, *rest, low):
    """One (batch, value head) at chunk n: v_new = u - w S, o = ol + qp S, S <- D S + kd^T v_new. rest: (every
    chunk's incoming state, v_new) outputs for the backward, or none, then the state scratch."""
    *saved_refs, state_ref = rest
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        state_ref[...] = s_init_ref[...]

    state = state_ref[...]
    w, qp, kd = (_load(low, r) for r in (w_ref, qp_ref, kd_ref))
    v_new = u_ref[...].astype(_F32) - blk.mm(w, _operand(low, state, w))
    if saved_refs:
        saved_refs[0][...] = state
        saved_refs[1][...] = v_new.astype(saved_refs[1].dtype)
    o_ref[...] = (ol_ref[...].astype(_F32) + blk.mm(qp, _operand(low, state, qp))).astype(o_ref.dtype)
    state = d_ref[...] * state + blk.mm_tn(kd, _operand(low, v_new, kd))
    state_ref[...] = state

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        s_out_ref[...] = state


def state_scan(cfg, w, qp, kd, u, ol, d_col, initial_state, *, out_dtype, save_states):
    """w, qp, kd [B, HV, N, C, K]; u, ol [B, HV, N, C, V]; d_col [B, HV, N, K, 1]; initial_state [B, HV, K, V].
    Returns o [B, HV, N, C, V], the final state and, if save_states, every chunk's incoming state [B, HV, N, K, V]
    fp32 and v_new [B, HV, N, C, V] in u's dtype."""
    batch, value_heads, chunks, chunk, key_dim = w.shape
    value_dim = u.shape[-1]
    state_spec = _head_state(key_dim, value_dim)
    out_shape = [jax.ShapeDtypeStruct(u.shape, out_dtype), jax.ShapeDtypeStruct(initial_state.shape, _F32)]
    out_specs = [_tile(chunk, value_dim), state_spec]
    if save_states:
        out_shape += [jax.ShapeDtypeStruct((batch, value_heads, chunks, key_dim, value_dim), _F32),
                      jax.ShapeDtypeStruct(u.shape, u.dtype)]
        out_specs += [_tile(key_dim, value_dim), _tile(chunk, value_dim)]
    return _call(_scan_kernel, cfg, grid=(batch, value_heads, chunks),
                 in_specs=[_tile(chunk, key_dim)] * 3 + [_tile(chunk, value_dim)] * 2 + [_tile(key_dim, 1),
                                                                                          state_spec],
                 out_specs=out_specs, out_shape=out_shape, scan=True,
                 scratch=[pltpu.VMEM((key_dim, value_dim), _F32)], name="kda_tpu_state_fwd", low=cfg.low,
                 )(w, qp, kd, u, ol, d_col, initial_state)


@_body
def _state_grad_kernel(w_ref, qp_ref, kd_ref, d_ref, do_ref, ds_final_ref, ds_chunk_ref, dv_new_ref, ds_init_ref,
                       ds_ref, *, low):
    """One (batch, value head), last chunk first: dS (of the chunk's outgoing state) stored, dV_new = kd dS,
    dS <- D dS + qp^T dO - w^T dV_new."""
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        ds_ref[...] = ds_final_ref[...]

    ds = ds_ref[...]
    ds_chunk_ref[...] = ds
    w, qp, kd = (_load(low, r) for r in (w_ref, qp_ref, kd_ref))
    dv_new = blk.mm(kd, _operand(low, ds, kd))
    dv_new_ref[...] = dv_new
    ds = d_ref[...] * ds + blk.mm_tn(qp, _operand(low, do_ref[...].astype(_F32), qp)) - blk.mm_tn(
        w, _operand(low, dv_new, w))
    ds_ref[...] = ds

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        ds_init_ref[...] = ds


def state_grad(cfg, w, qp, kd, d_col, do, ds_final):
    """The reverse recurrence. do: [B, HV, N, C, V]. Returns dS_out of every chunk [B, HV, N, K, V], dV_new
    [B, HV, N, C, V] (fp32) and dS of the initial state [B, HV, K, V]."""
    batch, value_heads, chunks, chunk, key_dim = w.shape
    value_dim = do.shape[-1]
    rev = functools.partial(_tile, reverse_of=chunks)
    state_spec = _head_state(key_dim, value_dim)
    return _call(_state_grad_kernel, cfg, grid=(batch, value_heads, chunks),
                 in_specs=[rev(chunk, key_dim)] * 3 + [rev(key_dim, 1), rev(chunk, value_dim), state_spec],
                 out_specs=[rev(key_dim, value_dim), rev(chunk, value_dim), state_spec],
                 out_shape=[jax.ShapeDtypeStruct((batch, value_heads, chunks, key_dim, value_dim), _F32),
                            jax.ShapeDtypeStruct(do.shape, _F32), jax.ShapeDtypeStruct(ds_final.shape, _F32)],
                 scan=True, scratch=[pltpu.VMEM((key_dim, value_dim), _F32)], name="kda_tpu_state_bwd",
                 low=cfg.low)(w, qp, kd, d_col, do, ds_final)


@_body
def _state_side_kernel(s0_ref, ds_ref, v_new_ref, do_ref, dv_new_ref, dqp_ref, dw_ref, dkd_ref, dd_ref):
    """dqp = dO S0^T, dw = -dV_new S0^T, dkd = V_new dS^T, dD = rowsum(S0 * dS) (as a [K, 1] column)."""
    s0, ds = s0_ref[...], ds_ref[...]
    dqp_ref[...] = blk.mm_nt(do_ref[...].astype(_F32), s0)
    dw_ref[...] = -blk.mm_nt(dv_new_ref[...], s0)
    dkd_ref[...] = blk.mm_nt(v_new_ref[...].astype(_F32), ds)
    dd_ref[...] = jnp.sum(s0 * ds, axis=1, keepdims=True)


def state_side_grads(cfg, s0, ds, v_new, do, dv_new):
    """s0, ds [B, HV, N, K, V]; v_new, do, dv_new [B, HV, N, C, V]. Returns dqp, dw, dkd [B, HV, N, C, K] and
    dd [B, HV, N, K, 1] (fp32)."""
    batch, value_heads, chunks, key_dim, value_dim = s0.shape
    chunk = v_new.shape[3]
    key_out = jax.ShapeDtypeStruct((batch, value_heads, chunks, chunk, key_dim), _F32)
    return _call(_state_side_kernel, cfg, grid=(batch, value_heads, chunks),
                 in_specs=[_tile(key_dim, value_dim)] * 2 + [_tile(chunk, value_dim)] * 3,
                 out_specs=[_tile(chunk, key_dim)] * 3 + [_tile(key_dim, 1)],
                 out_shape=[key_out] * 3 + [jax.ShapeDtypeStruct((batch, value_heads, chunks, key_dim, 1), _F32)],
                 name="kda_tpu_state_side_bwd")(s0, ds, v_new, do, dv_new)


@_body
def _score_grad_kernel(k_ref, v_ref, g_ref, beta_ref, doc_ref, doc_row_ref, doc_in_ref, aqk_ref, akk_ref, t_ref,
                       w_ref, u_ref, do_ref, du_ref, dqp_ref, dw_ref, daqk_ref, dakk_ref, dkb_ref, dv_ref, dbeta_ref):
    x = _chunk_in(k_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, doc_row_ref, doc_in_ref, scale=1.0)
    load = lambda ref: ref[...].astype(_F32)  # noqa: E731
    outs = backward_scores(x, k_base(x, blk.cumsum_rows(x.g)),
                           *map(load, (aqk_ref, akk_ref, t_ref, w_ref, u_ref, do_ref, du_ref, dqp_ref, dw_ref)))
    for ref, value in zip((daqk_ref, dakk_ref, dkb_ref, dv_ref, dbeta_ref), outs):
        ref[...] = value


@_body
def _input_grad_kernel(q_ref, k_ref, g_ref, beta_ref, doc_ref, doc_row_ref, doc_in_ref, daqk_ref, dakk_ref, dkb_ref,
                       dqp_ref, dkd_ref, dd_ref, dq_ref, dk_ref, dg_ref, *, scale, dense):
    x = _chunk_in(q_ref, k_ref, None, g_ref, beta_ref, doc_ref, doc_row_ref, doc_in_ref, scale=scale)
    dq, dk, dg = backward_inputs(x, chunk_gates(x), daqk_ref[...], dakk_ref[...], dkb_ref[...], dqp_ref[...],
                                 dkd_ref[...], dd_ref[...], dense=dense)
    dq_ref[...], dk_ref[...], dg_ref[...] = dq * scale, dk, dg


def intra_grads(cfg, inputs, saved, do, dv_new, dqp, dw, dkd, dd_row):
    """Input gradients per value head: dq, dk, dg [B, HV, N, C, K] (dq, dk to be summed over each q/k head's group),
    dv [B, HV, N, C, V], dbeta [B, HV, N, C, 1], all fp32. saved: the forward's (Aqk, Akk, T, w, u)."""
    q, k, v, g, beta, doc, doc_row, doc_in = inputs
    batch, heads, chunks, chunk, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[4]
    group = value_heads // heads
    specs = _input_specs(inputs, group)
    shape = lambda d: jax.ShapeDtypeStruct((batch, value_heads, chunks, chunk, d), _F32)  # noqa: E731
    cc, ck, cv = _tile(chunk, chunk), _tile(chunk, key_dim), _tile(chunk, value_dim)
    grid = (batch, value_heads, chunks)
    daqk, dakk, dkb, dv, dbeta = _call(
        _score_grad_kernel, cfg, grid=grid,
        in_specs=[specs[1]] + specs[2:] + [cc] * 3 + [ck, cv, cv, cv, ck, ck],
        out_specs=[cc, cc, ck, cv, _tile(chunk, 1)],
        out_shape=[shape(chunk)] * 2 + [shape(key_dim), shape(value_dim), shape(1)],
        name="kda_tpu_score_bwd")(k, v, g, beta, doc, doc_row, doc_in, *saved, do, dv_new, dqp, dw)
    dq, dk, dg = _call(
        _input_grad_kernel, cfg, grid=grid,
        in_specs=specs[:2] + specs[3:] + [cc, cc, ck, ck, ck, _tile(1, key_dim)],
        out_specs=[ck] * 3, out_shape=[shape(key_dim)] * 3, name="kda_tpu_input_bwd", scale=cfg.scale,
        dense=cfg.dense)(q, k, g, beta, doc, doc_row, doc_in, daqk, dakk, dkb, dqp, dkd, dd_row)
    return dq, dk, dv, dg, dbeta


def _forward(cfg, inputs, state, *, save_states):
    v = inputs[2]
    store = v.dtype if v.dtype in (jnp.bfloat16, jnp.float16) else _F32
    w, qp, kd, u, ol, d, *scores = intra_forward(cfg, inputs, store_dtype=store, save_scores=save_states)
    d_col = d.reshape(*d.shape[:3], d.shape[4], 1)  # [.., 1, K] -> [.., K, 1]: the same memory
    outs = state_scan(cfg, w, qp, kd, u, ol, d_col, state, out_dtype=v.dtype, save_states=save_states)
    return outs, (w, qp, kd, u, d_col, *scores)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(cfg, q, k, v, g, beta, state, doc, doc_row, doc_in):
    (o, final), _ = _forward(cfg, (q, k, v, g, beta, doc, doc_row, doc_in), state, save_states=False)
    return o, final


def _kda_fwd(cfg, q, k, v, g, beta, state, doc, doc_row, doc_in):
    inputs = (q, k, v, g, beta, doc, doc_row, doc_in)
    (o, final, states, v_new), inter = _forward(cfg, inputs, state, save_states=True)
    return (o, final), (inputs, states, v_new, inter)


def _kda_bwd(cfg, residuals, cotangents):
    inputs, states, v_new, (w, qp, kd, u, d_col, aqk, akk, t) = residuals
    q, k, v, g, beta = inputs[:5]
    do, ds_final = cotangents
    ds_chunk, dv_new, ds_init = state_grad(cfg, w, qp, kd, d_col, do, ds_final.astype(_F32))
    dqp, dw, dkd, dd = state_side_grads(cfg, states, ds_chunk, v_new, do, dv_new)
    dd_row = dd.reshape(*dd.shape[:3], 1, dd.shape[3])
    dq, dk, dv, dg, dbeta = intra_grads(cfg, inputs, (aqk, akk, t, w, u), do, dv_new, dqp, dw, dkd, dd_row)
    batch, heads = q.shape[:2]
    sum_group = lambda x: x.reshape(batch, heads, -1, *x.shape[2:]).sum(axis=2)  # noqa: E731
    return (sum_group(dq).astype(q.dtype), sum_group(dk).astype(k.dtype), dv.astype(v.dtype), dg,
            dbeta.astype(beta.dtype), ds_init, None, None, None)


_kda.defvjp(_kda_fwd, _kda_bwd)


def kda_pallas_tpu(q, k, v, g, beta, initial_state, segment_ids, *, scale, chunk_size, diagonal, interpret=False):
    """Backend entry (see api.BACKENDS): T a multiple of chunk_size; returns (o [B, T, HV, V] in v's dtype, state).
    interpret=True runs the kernels in Pallas' TPU interpreter (any platform)."""
    from pallas_kernels.kda.pallas_op import CHUNK_RANGE, pallas_dense

    low, high = CHUNK_RANGE
    if not low <= chunk_size <= high or chunk_size % ROWS:
        raise ValueError(f"chunk_kda(backend='pallas_tpu'): chunk_size must be a multiple of {ROWS} in [{low}, "
                         f"{high}], got {chunk_size}")
    batch, seq_len, heads, key_dim = q.shape
    value_heads = v.shape[2]
    chunks = seq_len // chunk_size
    doc = (jnp.zeros((batch, seq_len), jnp.int32) if segment_ids is None else document_index(segment_ids))
    doc_prev = jnp.concatenate([doc[:, :1], doc[:, :-1]], axis=1)
    doc = doc.reshape(batch, chunks, chunk_size)
    # The state entering chunk n belongs to the document of token n*C - 1 (chunk 0: the first document).
    doc_in = doc_prev.reshape(batch, chunks, chunk_size)[:, :, :1, None]
    precision = lax.Precision.HIGHEST if q.dtype == _F32 else lax.Precision.HIGH
    cfg = _Config(float(scale), pallas_dense(diagonal), interpret, precision, low=v.dtype != _F32)

    def heads_major(x):  # [B, T, H, D] -> [B, H, N, C, D]
        return x.reshape(batch, chunks, chunk_size, x.shape[2], -1).transpose(0, 3, 1, 2, 4)

    o, state = _kda(cfg, heads_major(q), heads_major(k), heads_major(v), heads_major(g.astype(_F32)),
                    heads_major(beta[..., None]), initial_state, doc[..., None], doc[:, :, None, :], doc_in)
    del heads, key_dim, value_heads
    return o.transpose(0, 2, 3, 1, 4).reshape(v.shape), state
