"""The state scans as Mosaic GPU kernels (`plgpu.kernel`, Tuning.mosaic_scan): warpgroup MMAs on shared-memory
operands that a TMA pipeline (`plgpu.emit_pipeline`) loads one chunk ahead. states_scan has the contract of
pallas_scan._states_scan with Tuning.scan_low_precision (the state and v_new rounded to bf16 as MMA operands, fp32
accumulation, fp32 carried state): per (batch, value head, value tile), S <- D S + kd^T (u - w S), storing every
chunk's incoming state and v_new. state_grad_scan is pallas_bwd.state_grad's reverse recurrence. states_output_scan
(Tuning.mosaic_output) is the inference forward's scan with o computed in it instead of storing S and v_new.

One warpgroup per program. Per chunk: the incoming state is stored (bf16) into a shared-memory buffer that a TMA
store copies out and that is the right operand of v_new = u - w S ([C, K] x [K, Vt]); v_new likewise, the right
operand of kd^T v_new ([K, C] x [C, Vt], kd read transposed from shared memory), added to D S. The two buffers
alternate between chunks, so a chunk's stores overlap the next chunk's products.
"""

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_F32 = jnp.float32
TILES = (16, 32, 64)  # value channels per program


def _transforms(tile, itemsize=2):
    """Shared-memory transforms of a [rows, tile] buffer (and, bf16, of every MMA operand beside it: a wgmma's two
    shared-memory operands must share their swizzle, so w and kd take the value tile's, 2 * tile bytes)."""
    swizzle = min(128, tile * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _fits(chunk, key_dim, value_dim, tile):
    return tile in TILES and value_dim % tile == 0 and chunk % 64 == 0 and key_dim % 64 == 0


def _check(name, arrays, chunk, key_dim, value_dim, tile):
    if any(x.dtype != jnp.bfloat16 for x in arrays):
        raise ValueError(f"mosaic {name}: the chunk tiles must be bf16, got {[str(x.dtype) for x in arrays]}")
    if not _fits(chunk, key_dim, value_dim, tile):
        raise ValueError(f"mosaic {name}: the value tile must be one of {TILES} and divide V, and C and K multiples "
                         f"of 64; got tile={tile}, V={value_dim}, C={chunk}, K={key_dim}")


def _interpreted(interpret):
    """Mosaic GPU's interpreter (on the CPU) for interpret=True or an InterpretGPUParams (e.g. detect_races=True);
    pallas_call's interpret=True would be Triton's."""
    if not interpret:
        return contextlib.nullcontext()
    params = interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()
    return plgpu.force_gpu_interpret_mode(params)


def use(tuning, w, *others, tile):
    """Whether a scan runs here (Tuning.mosaic_scan) rather than in its Triton kernel: asked for, with bf16 operand
    products (scan_low_precision), bf16 chunk tiles w and `others` ([BN, HV, C, K] first, the values last) and a
    layout the kernels take (_fits)."""
    chunk, key_dim = w.shape[2:]
    return bool(tuning.mosaic_scan and tuning.scan_low_precision
                and all(x.dtype == jnp.bfloat16 for x in (w, *others))
                and _fits(chunk, key_dim, others[-1].shape[-1], tile))


def _load_state(src_g, smem, barrier):
    """A [K, tile] fp32 state from global memory into registers (WGMMA layout), through `smem`."""
    plgpu.copy_gmem_to_smem(src_g, smem, barrier)
    plgpu.barrier_wait(barrier)
    return plgpu.load(smem, (), layout=plgpu.Layout.WGMMA)


def _store_state(state, smem, dst_g):
    """The inverse of _load_state, waiting for the copy to finish."""
    smem[...] = state
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst_g)
    plgpu.wait_smem_to_gmem(0)


def _load_decay(d_s, key_dim, tile):
    """The chunk's decay D [K] from its pipeline buffer, broadcast over the value tile in the WGMMA layout."""
    decay = plgpu.load(d_s, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return plgpu.layout_cast(lax.broadcast_in_dim(decay, (key_dim, tile), (0,)), plgpu.Layout.WGMMA)


def _mma(shape, *products):
    """The sum of the warpgroup MMAs a @ b over `products` ((a, b) shared-memory refs or views), in a scoped fp32
    accumulator of `shape`, returned in registers (the read waits for the MMAs)."""

    def run(acc):
        for a, b in products:
            plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, _F32))


def _v_new_and_decay(u_s, w_s, state_s, d_s, key_dim, tile):
    """v_new = u - w S (fp32, WGMMA layout) and the chunk's decay D, both read from the pipeline's buffers before the
    warpgroup's next synchronisation (commit_smem): once the step returns, the pipeline refills them."""
    v_new = plgpu.load(u_s, (), layout=plgpu.Layout.WGMMA).astype(_F32) - _mma((u_s.shape[0], tile), (w_s, state_s))
    return v_new, _load_decay(d_s, key_dim, tile)


class _Scan(NamedTuple):
    """The sizes of a forward scan over chunk tiles w [BN, HV, C, K] and u [BN, HV, C, V] from an initial state
    [B, HV, K, V], and the shared-memory transforms of its bf16 operands."""

    chunks: int
    value_heads: int
    chunk: int
    key_dim: int
    value_dim: int
    batch: int
    num_chunks: int
    dtype: object
    operand: tuple


def _forward_scan(name, w, u, initial_state, tile, *tiles):
    """_Scan of a forward scan, after _check on w, the other `tiles` and u."""
    chunks, value_heads, chunk, key_dim = w.shape
    value_dim = u.shape[-1]
    batch = initial_state.shape[0]
    _check(name, (w, *tiles, u), chunk, key_dim, value_dim, tile)
    return _Scan(chunks, value_heads, chunk, key_dim, value_dim, batch, chunks // batch, u.dtype, _transforms(tile))


def states_scan(w, kd, u, d, initial_state, *, tile=32, interpret=False):
    """w, kd: [BN, HV, C, K]; u: [BN, HV, C, V] (bf16); d: [BN, HV, K] fp32; initial_state: [B, HV, K, V] fp32;
    interpret: False, True or a plgpu.InterpretGPUParams (_interpreted). Returns (final state [B, HV, K, V] fp32,
    every chunk's incoming state [BN, HV, K, V] and v_new [BN, HV, C, V] in u's dtype)."""
    chunks, value_heads, chunk, key_dim, value_dim, batch, num_chunks, dtype, operand = _forward_scan(
        "states_scan", w, u, initial_state, tile, kd)

    def body(w_g, kd_g, u_g, d_g, s0_g, s_out_g, states_g, v_new_g, s_smem, states_smem, v_new_smem, bar):
        b, h, t = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
        rows, cols = pl.ds(b * num_chunks, num_chunks), pl.ds(t * tile, tile)
        state = _load_state(s0_g.at[b, h, :, cols], s_smem, bar.at[0])

        def step(index, w_s, kd_s, u_s, d_s, state):
            n = index[0]
            slot = lax.rem(n, 2)
            states_s, v_new_s = states_smem.at[slot], v_new_smem.at[slot]
            plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # this slot's stores of two chunks ago have read it
            states_s[...] = state.astype(dtype)  # this chunk's incoming state: stored, and the next MMA's operand
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(states_s, states_g.at[b * num_chunks + n, h, :, cols])

            v_new, decay = _v_new_and_decay(u_s, w_s, states_s, d_s, key_dim, tile)
            v_new_s[...] = v_new.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(v_new_s, v_new_g.at[b * num_chunks + n, h, :, cols])
            return decay * state + _mma((key_dim, tile), (kd_s.T, v_new_s))

        keys = plgpu.BlockSpec((None, chunk, key_dim), lambda n: (n, 0, 0), transforms=operand)
        pipeline = plgpu.emit_pipeline(
            step, grid=(num_chunks,),
            in_specs=[keys, keys, plgpu.BlockSpec((None, chunk, tile), lambda n: (n, 0, 0), transforms=operand),
                      plgpu.BlockSpec((None, key_dim), lambda n: (n, 0))],
            max_concurrent_steps=2, init_carry=state)
        state = pipeline(w_g.at[rows, h], kd_g.at[rows, h], u_g.at[rows, h, :, cols], d_g.at[rows, h])
        _store_state(state, s_smem, s_out_g.at[b, h, :, cols])

    with _interpreted(interpret):
        return _states_kernel(body, u, initial_state, key_dim, tile, "kda_states_fwd_mosaic")(w, kd, u, d,
                                                                                             initial_state)


def _states_kernel(body, u, initial_state, key_dim, tile, name):
    """The plgpu.kernel of a forward state scan `body` (states_scan, states_scan_lookahead): outputs the final state
    (fp32), every chunk's incoming state and v_new (u's dtype); scratch: an fp32 [K, tile] state buffer, two bf16
    slots each for the stored state and v_new, one barrier; grid (batch, value heads, value tiles)."""
    chunks, value_heads, chunk, value_dim = u.shape
    dtype, operand = u.dtype, _transforms(tile)
    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(initial_state.shape, _F32),
                  jax.ShapeDtypeStruct((chunks, value_heads, key_dim, value_dim), dtype),
                  jax.ShapeDtypeStruct(u.shape, dtype)),
        scratch_types=[plgpu.SMEM((key_dim, tile), _F32, transforms=_transforms(tile, 4)),
                       plgpu.SMEM((2, key_dim, tile), dtype, transforms=operand),
                       plgpu.SMEM((2, chunk, tile), dtype, transforms=operand),
                       plgpu.Barrier(num_barriers=1)],
        grid=(initial_state.shape[0], value_heads, value_dim // tile), grid_names=("b", "h", "t"), kernel_name=name,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )


def lookahead_operands(w, kd, d, batch):
    """The per-chunk operands of states_scan_lookahead: A_n = w_n diag(d_(n-1)) [BN, HV, C, K] and
    B_n = w_n kd_(n-1)^T [BN, HV, C, C], in w's dtype (fp32 products), with d_(-1) = 1 and kd_(-1) = 0 at each
    sequence's first chunk."""
    chunks, value_heads, chunk, key_dim = w.shape
    split = lambda x: x.reshape(batch, chunks // batch, *x.shape[1:])  # noqa: E731
    w5, kd5, d5 = split(w), split(kd), split(d)
    d_prev = jnp.concatenate([jnp.ones_like(d5[:, :1]), d5[:, :-1]], axis=1)
    kd_prev = jnp.concatenate([jnp.zeros_like(kd5[:, :1]), kd5[:, :-1]], axis=1)
    a = (w5.astype(_F32) * d_prev[..., None, :]).astype(w.dtype)
    b = jnp.einsum("bnhck,bnhjk->bnhcj", w5, kd_prev, preferred_element_type=_F32).astype(w.dtype)
    return a.reshape(w.shape), b.reshape(chunks, value_heads, chunk, chunk)


def states_scan_lookahead(w, kd, u, d, initial_state, *, tile=32, interpret=False):
    """states_scan's contract (final state, every chunk's incoming state and v_new) with one warpgroup MMA latency
    per chunk on the serial path instead of two (Tuning.scan_lookahead). states_scan forms S_n = D S_(n-1) +
    kd^T v_(n-1) and then v_n = u_n - w_n S_n, one product waiting for the other. Substituting the first into the
    second, v_n = u_n - A_n S_(n-1) - B_n v_(n-1) with A_n = w_n diag(d_(n-1)) and B_n = w_n kd_(n-1)^T
    (lookahead_operands, parallel over chunks): both v_n and S_n then depend only on the previous step's S and v,
    and their products are issued together. Step n reads A_n, B_n, u_n and kd_(n-1), d_(n-1); one extra step after
    the last chunk forms the final state. The shared-memory S and v of the previous step are the MMAs' operands
    (bf16, as states_scan rounds them; A_n and B_n are rounded to bf16 too)."""
    chunks, value_heads, chunk, key_dim, value_dim, batch, num_chunks, dtype, operand = _forward_scan(
        "states_scan_lookahead", w, u, initial_state, tile, kd)
    a, b_mat = lookahead_operands(w, kd, d, batch)

    def body(a_g, b_g, kd_g, d_g, u_g, s0_g, s_out_g, states_g, v_new_g, s_smem, states_smem, v_new_smem, bar):
        b, h, t = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
        rows, cols = pl.ds(b * num_chunks, num_chunks), pl.ds(t * tile, tile)
        state = _load_state(s0_g.at[b, h, :, cols], s_smem, bar.at[0])
        states_smem.at[1][...] = state.astype(dtype)  # S_(-1) = S0 (with d_(-1) = 1, kd_(-1) = 0, v_(-1) = 0)
        v_new_smem.at[1][...] = plgpu.layout_cast(jnp.zeros((chunk, tile), dtype), plgpu.Layout.WGMMA)
        plgpu.commit_smem()

        def step(index, a_s, b_s, kd_s, d_s, u_s, state):
            n = index[0]
            slot = lax.rem(n, 2)
            prev = 1 - slot
            state_prev, v_prev = states_smem.at[prev], v_new_smem.at[prev]

            def products(acc_v, acc_s):
                plgpu.wgmma(acc_v, a_s, state_prev)
                plgpu.wgmma(acc_v, b_s, v_prev)
                plgpu.wgmma(acc_s, kd_s.T, v_prev)
                return acc_v[...], acc_s[...]

            carried, update = pl.run_scoped(products, plgpu.ACC((chunk, tile), _F32), plgpu.ACC((key_dim, tile), _F32))
            decay = _load_decay(d_s, key_dim, tile)
            decay = jnp.where(n == 0, jnp.ones_like(decay), decay)
            v_new = plgpu.load(u_s, (), layout=plgpu.Layout.WGMMA).astype(_F32) - carried
            state = decay * state + update  # S_n, the incoming state of chunk n (the final state at n = N)

            @pl.when(n < num_chunks)
            def _():
                plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # this slot's stores of two chunks ago have read it
                states_smem.at[slot][...] = state.astype(dtype)
                v_new_smem.at[slot][...] = v_new.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(states_smem.at[slot], states_g.at[b * num_chunks + n, h, :, cols])
                plgpu.copy_smem_to_gmem(v_new_smem.at[slot], v_new_g.at[b * num_chunks + n, h, :, cols])

            return state

        last = num_chunks - 1
        this = lambda n: jnp.minimum(n, last)  # noqa: E731  (the extra step n = N reads chunk N - 1 again, unused)
        before = lambda n: jnp.maximum(n - 1, 0)  # noqa: E731
        pipeline = plgpu.emit_pipeline(
            step, grid=(num_chunks + 1,),
            in_specs=[plgpu.BlockSpec((None, chunk, key_dim), lambda n: (this(n), 0, 0), transforms=operand),
                      plgpu.BlockSpec((None, chunk, chunk), lambda n: (this(n), 0, 0), transforms=operand),
                      plgpu.BlockSpec((None, chunk, key_dim), lambda n: (before(n), 0, 0), transforms=operand),
                      plgpu.BlockSpec((None, key_dim), lambda n: (before(n), 0)),
                      plgpu.BlockSpec((None, chunk, tile), lambda n: (this(n), 0, 0), transforms=operand)],
            max_concurrent_steps=2, init_carry=state)
        state = pipeline(a_g.at[rows, h], b_g.at[rows, h], kd_g.at[rows, h], d_g.at[rows, h],
                         u_g.at[rows, h, :, cols])
        _store_state(state, s_smem, s_out_g.at[b, h, :, cols])

    with _interpreted(interpret):
        return _states_kernel(body, u, initial_state, key_dim, tile, "kda_states_fwd_lookahead_mosaic")(
            a, b_mat, kd, d, u, initial_state)


def states_output_scan(w, kd, u, d, qg, aqk, initial_state, *, out_dtype, tile=32, interpret=False):
    """The inference forward's scan with o computed in it (Tuning.mosaic_output): per chunk, besides the recurrence of
    states_scan, o = qg S + Aqk v_new from the incoming state and v_new while they sit in shared memory, so that
    neither is written out and no output kernel reads them back. Aqk (fp32) enters the MMA as two bf16 parts, hi and
    lo = Aqk - hi, whose products sum to more precision than TF32's. w, kd, qg: [BN, HV, C, K]; u: [BN, HV, C, V]
    (bf16); d: [BN, HV, K] fp32; aqk: [BN, HV, C, C] fp32 or bf16; initial_state: [B, HV, K, V] fp32. Returns
    (o [BN, C, HV, V] in out_dtype, final state [B, HV, K, V] fp32)."""
    chunks, value_heads, chunk, key_dim, value_dim, batch, num_chunks, dtype, operand = _forward_scan(
        "states_output_scan", w, u, initial_state, tile, kd, qg)
    split = aqk.dtype == _F32  # a bf16 Aqk is its own hi part

    def body(w_g, kd_g, u_g, d_g, qg_g, aqk_g, s0_g, o_g, s_out_g, s_smem, state_smem, v_new_smem, parts_smem,
             o_smem, bar):
        b, h, t = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
        rows, cols = pl.ds(b * num_chunks, num_chunks), pl.ds(t * tile, tile)
        state = _load_state(s0_g.at[b, h, :, cols], s_smem, bar.at[0])

        def step(index, w_s, kd_s, u_s, d_s, qg_s, aqk_s, state):
            n = index[0]
            slot = lax.rem(n, 2)
            scores = plgpu.load(aqk_s, (), layout=plgpu.Layout.WGMMA).astype(_F32)
            hi = scores.astype(dtype)
            parts_smem.at[0][...] = hi
            if split:
                parts_smem.at[1][...] = (scores - hi.astype(_F32)).astype(dtype)
            state_smem[...] = state.astype(dtype)  # the MMAs' operand: S as they round it
            plgpu.commit_smem()

            v_new, decay = _v_new_and_decay(u_s, w_s, state_smem, d_s, key_dim, tile)
            v_new_smem[...] = v_new.astype(dtype)
            plgpu.commit_smem()
            parts = [parts_smem.at[0]] + ([parts_smem.at[1]] if split else [])  # Aqk's hi (and lo) part
            o = _mma((chunk, tile), (qg_s, state_smem), *((part, v_new_smem) for part in parts))
            o_s = o_smem.at[slot]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's store of two chunks ago has read it
            o_s[...] = o.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_g.at[b * num_chunks + n, :, h, cols])
            return decay * state + _mma((key_dim, tile), (kd_s.T, v_new_smem))

        keys = plgpu.BlockSpec((None, chunk, key_dim), lambda n: (n, 0, 0), transforms=operand)
        pipeline = plgpu.emit_pipeline(
            step, grid=(num_chunks,),
            in_specs=[keys, keys, plgpu.BlockSpec((None, chunk, tile), lambda n: (n, 0, 0), transforms=operand),
                      plgpu.BlockSpec((None, key_dim), lambda n: (n, 0)), keys,
                      plgpu.BlockSpec((None, chunk, chunk), lambda n: (n, 0, 0),
                                      transforms=_transforms(chunk, aqk.dtype.itemsize))],
            max_concurrent_steps=2, init_carry=state)
        state = pipeline(w_g.at[rows, h], kd_g.at[rows, h], u_g.at[rows, h, :, cols], d_g.at[rows, h],
                         qg_g.at[rows, h], aqk_g.at[rows, h])
        _store_state(state, s_smem, s_out_g.at[b, h, :, cols])  # its wait covers the last chunks' o stores too

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((chunks, chunk, value_heads, value_dim), out_dtype),
                  jax.ShapeDtypeStruct(initial_state.shape, _F32)),
        scratch_types=[plgpu.SMEM((key_dim, tile), _F32, transforms=_transforms(tile, 4)),
                       plgpu.SMEM((key_dim, tile), dtype, transforms=operand),
                       plgpu.SMEM((chunk, tile), dtype, transforms=operand),
                       plgpu.SMEM((2, chunk, chunk), dtype, transforms=operand),
                       plgpu.SMEM((2, chunk, tile), out_dtype,
                                  transforms=_transforms(tile, jnp.dtype(out_dtype).itemsize)),
                       plgpu.Barrier(num_barriers=1)],
        grid=(batch, value_heads, value_dim // tile), grid_names=("b", "h", "t"),
        kernel_name="kda_states_output_fwd_mosaic",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    with _interpreted(interpret):
        return kernel(w, kd, u, d, qg, aqk, initial_state)


def state_grad_scan(w, qp, kd, d, do, ds_final, *, tile=32, interpret=False):
    """The reverse recurrence of pallas_bwd.state_grad as a Mosaic GPU kernel, last chunk first: dV_new = kd dS_out,
    dS_in = D dS_out + qp^T dO - w^T dV_new (dS_out and dV_new rounded to bf16 as MMA operands, fp32 accumulation).
    w, qp, kd: [BN, HV, C, K] bf16; d: [BN, HV, K] fp32; do: [BN, C, HV, V] bf16; ds_final: [B, HV, K, V] fp32.
    Returns (dS_out of every chunk [BN, HV, K, V] bf16, dV_new [BN, HV, C, V] fp32, dS of the initial state)."""
    chunks, value_heads, chunk, key_dim = w.shape
    batch, _, _, value_dim = ds_final.shape
    num_chunks = chunks // batch
    dtype = w.dtype
    _check("state_grad_scan", (w, qp, kd, do), chunk, key_dim, value_dim, tile)
    operand = _transforms(tile)

    def body(w_g, qp_g, kd_g, d_g, do_g, ds_final_g, ds_chunk_g, dv_new_g, ds_init_g, ds_smem, ds_chunk_smem,
             dv_new_smem, neg_dv_smem, bar):
        b, h, t = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
        rows, cols = pl.ds(b * num_chunks, num_chunks), pl.ds(t * tile, tile)
        ds = _load_state(ds_final_g.at[b, h, :, cols], ds_smem, bar.at[0])

        def step(index, w_s, qp_s, kd_s, d_s, do_s, ds):
            i = index[0]
            n, slot = b * num_chunks + num_chunks - 1 - i, lax.rem(i, 2)
            ds_s, dv_s = ds_chunk_smem.at[slot], dv_new_smem.at[slot]
            plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # this slot's stores of two chunks ago have read it
            ds_s[...] = ds.astype(dtype)  # stored, and the right operand of kd dS
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(ds_s, ds_chunk_g.at[n, h, :, cols])

            dv_new = _mma((chunk, tile), (kd_s, ds_s))
            # read before the warpgroup synchronises (commit_smem): once the step returns, the pipeline refills d_s
            decay = _load_decay(d_s, key_dim, tile)
            dv_s[...] = dv_new
            neg_dv_smem[...] = (-dv_new).astype(dtype)  # -w^T dV_new accumulates with qp^T dO
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dv_s, dv_new_g.at[n, h, :, cols])

            return decay * ds + _mma((key_dim, tile), (qp_s.T, do_s), (w_s.T, neg_dv_smem))

        last = num_chunks - 1
        keys = plgpu.BlockSpec((None, chunk, key_dim), lambda i: (last - i, 0, 0), transforms=operand)
        pipeline = plgpu.emit_pipeline(
            step, grid=(num_chunks,),
            in_specs=[keys, keys, keys, plgpu.BlockSpec((None, key_dim), lambda i: (last - i, 0)),
                      plgpu.BlockSpec((None, chunk, tile), lambda i: (last - i, 0, 0), transforms=operand)],
            max_concurrent_steps=2, init_carry=ds)
        ds = pipeline(w_g.at[rows, h], qp_g.at[rows, h], kd_g.at[rows, h], d_g.at[rows, h], do_g.at[rows, :, h, cols])
        _store_state(ds, ds_smem, ds_init_g.at[b, h, :, cols])

    fp32_tile = _transforms(tile, 4)
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((chunks, value_heads, key_dim, value_dim), dtype),
                  jax.ShapeDtypeStruct((chunks, value_heads, chunk, value_dim), _F32),
                  jax.ShapeDtypeStruct(ds_final.shape, _F32)),
        scratch_types=[plgpu.SMEM((key_dim, tile), _F32, transforms=fp32_tile),
                       plgpu.SMEM((2, key_dim, tile), dtype, transforms=operand),
                       plgpu.SMEM((2, chunk, tile), _F32, transforms=fp32_tile),
                       plgpu.SMEM((chunk, tile), dtype, transforms=operand),
                       plgpu.Barrier(num_barriers=1)],
        grid=(batch, value_heads, value_dim // tile), grid_names=("b", "h", "t"), kernel_name="kda_state_bwd_mosaic",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    with _interpreted(interpret):
        return kernel(w, qp, kd, d, do, ds_final)


def states_scan_reference(w, kd, u, d, initial_state):
    """The same recurrence in jnp (operands rounded as the kernel rounds them), for tests."""
    chunks = w.shape[0]
    batch = initial_state.shape[0]
    split = functools.partial(_split, batch=batch)
    mm = functools.partial(jnp.einsum, preferred_element_type=_F32)

    def step(state, xs):
        w_n, kd_n, u_n, d_n = xs
        state_b = state.astype(u.dtype)
        v_new = u_n.astype(_F32) - mm("bhck,bhkv->bhcv", w_n, state_b)
        new = d_n[..., None] * state + mm("bhck,bhcv->bhkv", kd_n, v_new.astype(u.dtype))
        return new, (state_b, v_new.astype(u.dtype))

    final, (states, v_new) = lax.scan(step, initial_state, (split(w), split(kd), split(u), split(d)))
    return final, _merge(states, chunks), _merge(v_new, chunks)


def _split(x, batch):
    """[B * N, ...] -> [N, B, ...] (chunk-major, for lax.scan)."""
    return x.reshape(batch, x.shape[0] // batch, *x.shape[1:]).swapaxes(0, 1)


def _merge(x, chunks):
    return x.swapaxes(0, 1).reshape(chunks, *x.shape[2:])


def state_grad_scan_reference(w, qp, kd, d, do, ds_final):
    """state_grad_scan's recurrence in jnp (operands rounded as the kernel rounds them), for tests."""
    chunks = w.shape[0]
    batch = ds_final.shape[0]
    mm = lambda spec, a, b: jnp.einsum(spec, a.astype(_F32), b.astype(_F32))  # noqa: E731  (bf16 values, exact)

    def step(ds, xs):
        w_n, qp_n, kd_n, d_n, do_n = xs
        ds_b = ds.astype(w.dtype)
        dv_new = mm("bhck,bhkv->bhcv", kd_n, ds_b)
        ds_in = (d_n[..., None] * ds + mm("bhck,bchv->bhkv", qp_n, do_n)
                 - mm("bhck,bhcv->bhkv", w_n, dv_new.astype(w.dtype)))
        return ds_in, (ds_b, dv_new)

    xs = tuple(_split(x, batch)[::-1] for x in (w, qp, kd, d, do))
    ds_init, (ds_chunk, dv_new) = lax.scan(step, ds_final, xs)
    return _merge(ds_chunk[::-1], chunks), _merge(dv_new[::-1], chunks), ds_init
