"""The Pallas KDA backend: forward and backward kernels joined by a custom VJP.

Forward: a per-chunk kernel (parallel over batch, value heads and chunks) derives everything that does not depend on
the incoming state; a scan kernel (parallel over batch, value heads and value tiles; sequential over chunks) carries
the K x V state in fp32 and writes o. Backward: a reverse scan for the state gradient, then per-chunk kernels that
recompute the chunk's intra quantities (cheaper than storing them) and produce every input gradient. The forward
keeps each chunk's incoming state for the backward ([B, HV, N, K, V] fp32).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import pallas_blocks as blk
from pallas_kernels.kda.layout import document_index
from pallas_kernels.kda.pallas_bwd import intra_grads, state_grad, state_side_grads
from pallas_kernels.kda.pallas_fwd import Tuning, intra_forward
from pallas_kernels.kda.pallas_scan import scores_output_scan, state_scan

CHUNK_RANGE = (blk.ROWS, 128)


def pallas_dense(diagonal):
    """The kernels' sub-chunk is fixed at 16 rows: dense whenever the tiling allows dense blocks of at least 16 rows
    (kda_diagonal_path picks the largest safe height), else the exact pairwise diagonal."""
    path, rows = diagonal
    return path == "dense" and rows >= blk.ROWS


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    dense: bool
    interpret: bool
    tuning: Tuning
    # TF32 matmuls suit bf16/fp16 inputs; fp32 inputs get three-pass TF32 (about fp32 accuracy). The CPU interpreter
    # always multiplies in fp32.
    precision: object = None


def kda_pallas(q, k, v, g, beta, initial_state, segment_ids, *, scale, chunk_size, diagonal, interpret=False,
               tuning=Tuning()):
    """Backend entry (see api.BACKENDS): T a multiple of chunk_size; returns (o [B, T, HV, V] in v's dtype, state)."""
    low, high = CHUNK_RANGE
    if not low <= chunk_size <= high:
        raise ValueError(f"chunk_kda(backend='pallas'): chunk_size must be in [{low}, {high}], got {chunk_size}")
    batch, seq_len = q.shape[:2]
    if segment_ids is None:
        doc = jnp.zeros((batch, seq_len), jnp.int32)
    else:
        doc = document_index(segment_ids)
    # The state entering chunk n belongs to the document of token n*C - 1 (chunk 0: the first document).
    doc_prev = jnp.concatenate([doc[:, :1], doc[:, :-1]], axis=1)
    precise = q.dtype == jnp.float32 and not interpret
    cfg = _Config(float(scale), pallas_dense(diagonal), interpret, tuning,
                  jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if precise else None)
    chunked = lambda x: x.reshape(batch * seq_len // chunk_size, chunk_size, *x.shape[2:])  # noqa: E731
    o, state = _kda(cfg, *map(chunked, (q, k, v, g.astype(jnp.float32), beta)), initial_state,
                    chunked(doc), chunked(doc_prev))
    return o.reshape(v.shape), state


def lean_forward(tuning, store_dtype):
    """Whether the forward without a backward takes o from the scores (Tuning.output_from_scores): for 16-bit
    intermediates only. With fp32 ones its per-chunk output kernel reads a whole fp32 [K, V] state and [C, K] tiles
    with three-pass TF32 products: 192 KB of shared memory in a local sm_90a compile, too close to an SM's 227 KB
    (XLA's Triton asked for 15% more than that compile in the one kernel measured both ways)."""
    return tuning.output_from_scores and jnp.dtype(store_dtype).itemsize <= 2


def _forward(cfg, q, k, v, g, beta, state, doc, doc_prev, *, save_states):
    kw = dict(tuning=cfg.tuning, interpret=cfg.interpret, precision=cfg.precision)
    # bf16 inputs keep the intermediates in bf16 (half the scans' traffic; within the error bars), fp32 in fp32.
    store = v.dtype if v.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
    # Without a backward, o can come from the scores (Tuning.output_from_scores): no qp, ol to write and read.
    lean = not save_states and lean_forward(cfg.tuning, store)
    w, qp, kd, u, ol, d, *scores = intra_forward(q, k, v, g, beta, doc, doc_prev, scale=cfg.scale, dense=cfg.dense,
                                                 store_dtype=store, save_scores=save_states, lean=lean, **kw)
    if qp is None:  # the lean per-chunk outputs ran (no qp, ol): o from the scores
        outs = scores_output_scan(w, kd, u, d, scores[0], q, g, doc, doc_prev, state, scale=cfg.scale,
                                  out_dtype=v.dtype, qg=scores[1] if len(scores) > 1 else None, **kw)
        return outs, None
    outs = state_scan(w, qp, kd, u, ol, d, state, out_dtype=v.dtype, save_states=save_states, **kw)
    return outs, (w, qp, kd, u, d, *scores)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(cfg, q, k, v, g, beta, state, doc, doc_prev):
    """All arrays chunked: q, k [BN, C, H, K], v [BN, C, HV, V], g [BN, C, HV, K], beta [BN, C, HV], doc [BN, C]."""
    (o, final), _ = _forward(cfg, q, k, v, g, beta, state, doc, doc_prev, save_states=False)
    return o, final


def _kda_fwd(cfg, q, k, v, g, beta, state, doc, doc_prev):
    (o, final, states, v_new), inter = _forward(cfg, q, k, v, g, beta, state, doc, doc_prev, save_states=True)
    return (o, final), (q, k, v, g, beta, doc, doc_prev, states, v_new, inter)


def _kda_bwd(cfg, residuals, cotangents):
    q, k, v, g, beta, doc, doc_prev, states, v_new, (w, qp, kd, u, d, aqk, akk, t) = residuals
    do, ds_final = cotangents
    kw = dict(tuning=cfg.tuning, interpret=cfg.interpret, precision=cfg.precision)
    ds_chunk, dv_new, ds_init = state_grad(w, qp, kd, d, do, ds_final.astype(jnp.float32), **kw)
    dqp, dw, dkd, dd = state_side_grads(states, ds_chunk, v_new, do, dv_new, **kw)
    dq, dk, dv, dg, dbeta = intra_grads(q, k, v, g, beta, doc, doc_prev, (aqk, akk, t, w, u), do, dv_new, dqp, dw,
                                        dkd, dd, scale=cfg.scale, dense=cfg.dense, **kw)
    chunks, chunk, heads, key_dim = q.shape
    group = v.shape[2] // heads
    if group > 1:  # grouped value heads: the kernels wrote per-value-head fp32 gradients of q and k
        sum_group = lambda x: x.reshape(chunks, chunk, heads, group, key_dim).sum(axis=3)  # noqa: E731
        dq, dk = sum_group(dq).astype(q.dtype), sum_group(dk).astype(k.dtype)
    return dq, dk, dv, dg, dbeta.astype(beta.dtype), ds_init, None, None


_kda.defvjp(_kda_fwd, _kda_bwd)
