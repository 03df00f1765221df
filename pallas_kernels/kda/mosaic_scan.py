"""The forward state scan as a Mosaic GPU kernel (`plgpu.kernel`): warpgroup MMAs on shared-memory operands that a
TMA pipeline (`plgpu.emit_pipeline`) loads one chunk ahead. Same contract as pallas_scan._states_scan with
Tuning.scan_low_precision (the state and v_new rounded to bf16 as MMA operands, fp32 accumulation, fp32 carried
state): per (batch, value head, value tile), S <- D S + kd^T (u - w S), storing every chunk's incoming state and
v_new.

One warpgroup per program. Per chunk: the incoming state is stored (bf16) into a shared-memory buffer that a TMA
store copies out and that is the right operand of v_new = u - w S ([C, K] x [K, Vt]); v_new likewise, the right
operand of kd^T v_new ([K, C] x [C, Vt], kd read transposed from shared memory), added to D S. The two buffers
alternate between chunks, so a chunk's stores overlap the next chunk's products.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_F32 = jnp.float32
SWIZZLE = 64  # bytes: a 32-column bf16 tile row; every MMA operand uses the same swizzle


def _operand(swizzle=SWIZZLE, itemsize=2):
    """Shared-memory transforms of an MMA operand."""
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def supported(w, kd, u, *, tile=32):
    """Whether states_scan takes these operands: bf16 w, kd, u; C and K multiples of 64; V a multiple of `tile`."""
    chunk, key_dim = w.shape[2:]
    return (all(x.dtype == jnp.bfloat16 for x in (w, kd, u)) and chunk % 64 == 0 and key_dim % 64 == 0
            and u.shape[-1] % tile == 0)


def states_scan(w, kd, u, d, initial_state, *, tile=32, interpret=False):
    """w, kd: [BN, HV, C, K]; u: [BN, HV, C, V] (bf16); d: [BN, HV, K] fp32; initial_state: [B, HV, K, V] fp32.
    Returns (final state [B, HV, K, V] fp32, every chunk's incoming state [BN, HV, K, V] and v_new [BN, HV, C, V] in
    u's dtype)."""
    chunks, value_heads, chunk, key_dim = w.shape
    value_dim = u.shape[-1]
    batch = initial_state.shape[0]
    num_chunks = chunks // batch
    dtype = u.dtype
    if dtype != jnp.bfloat16 or w.dtype != dtype or kd.dtype != dtype:
        raise ValueError(f"mosaic states_scan: w, kd, u must be bf16, got {w.dtype}, {kd.dtype}, {dtype}")
    if value_dim % tile or tile * 2 != SWIZZLE or chunk % 64 or key_dim % 64:
        raise ValueError(f"mosaic states_scan: needs tile = {SWIZZLE // 2} dividing V, C and K multiples of 64; got "
                         f"tile={tile}, V={value_dim}, C={chunk}, K={key_dim}")

    def body(w_g, kd_g, u_g, d_g, s0_g, s_out_g, states_g, v_new_g, s_smem, states_smem, v_new_smem, bar):
        b, h, t = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
        rows, cols = pl.ds(b * num_chunks, num_chunks), pl.ds(t * tile, tile)
        plgpu.copy_gmem_to_smem(s0_g.at[b, h, :, cols], s_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        state = plgpu.load(s_smem, (), layout=plgpu.Layout.WGMMA)

        def step(index, w_s, kd_s, u_s, d_s, state):
            n = index[0]
            slot = lax.rem(n, 2)
            states_s, v_new_s = states_smem.at[slot], v_new_smem.at[slot]
            plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # this slot's stores of two chunks ago have read it
            states_s[...] = state.astype(dtype)  # this chunk's incoming state: stored, and the next MMA's operand
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(states_s, states_g.at[b * num_chunks + n, h, :, cols])

            def w_state(acc):
                plgpu.wgmma(acc, w_s, states_s)
                return acc[...]

            v_new = plgpu.load(u_s, (), layout=plgpu.Layout.WGMMA).astype(_F32) - pl.run_scoped(
                w_state, plgpu.ACC((chunk, tile), _F32))
            v_new_s[...] = v_new.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(v_new_s, v_new_g.at[b * num_chunks + n, h, :, cols])
            decay = plgpu.load(d_s, (), layout=plgpu.Layout.WGMMA.reduce(1))

            def update(acc):
                plgpu.wgmma(acc, kd_s.T, v_new_s)
                return acc[...]

            decay = plgpu.layout_cast(lax.broadcast_in_dim(decay, (key_dim, tile), (0,)), plgpu.Layout.WGMMA)
            return decay * state + pl.run_scoped(update, plgpu.ACC((key_dim, tile), _F32))

        keys = plgpu.BlockSpec((None, chunk, key_dim), lambda n: (n, 0, 0), transforms=_operand())
        pipeline = plgpu.emit_pipeline(
            step, grid=(num_chunks,),
            in_specs=[keys, keys, plgpu.BlockSpec((None, chunk, tile), lambda n: (n, 0, 0), transforms=_operand()),
                      plgpu.BlockSpec((None, key_dim), lambda n: (n, 0))],
            max_concurrent_steps=2, init_carry=state)
        state = pipeline(w_g.at[rows, h], kd_g.at[rows, h], u_g.at[rows, h, :, cols], d_g.at[rows, h])
        s_smem[...] = state
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s_smem, s_out_g.at[b, h, :, cols])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(initial_state.shape, _F32),
                  jax.ShapeDtypeStruct((chunks, value_heads, key_dim, value_dim), dtype),
                  jax.ShapeDtypeStruct(u.shape, dtype)),
        scratch_types=[plgpu.SMEM((key_dim, tile), _F32, transforms=_operand(4 * tile, 4)),
                       plgpu.SMEM((2, key_dim, tile), dtype, transforms=_operand()),
                       plgpu.SMEM((2, chunk, tile), dtype, transforms=_operand()),
                       plgpu.Barrier(num_barriers=1)],
        grid=(batch, value_heads, value_dim // tile), grid_names=("b", "h", "t"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    if not interpret:
        return kernel(w, kd, u, d, initial_state)
    with plgpu.force_gpu_interpret_mode():  # Mosaic GPU's interpreter (CPU); pallas_call's interpret=True is Triton's
        return kernel(w, kd, u, d, initial_state)


def states_scan_reference(w, kd, u, d, initial_state):
    """The same recurrence in jnp (operands rounded as the kernel rounds them), for tests."""
    chunks, value_heads, chunk, key_dim = w.shape
    batch = initial_state.shape[0]
    split = lambda x: x.reshape(batch, chunks // batch, *x.shape[1:]).swapaxes(0, 1)  # noqa: E731
    mm = functools.partial(jnp.einsum, preferred_element_type=_F32)

    def step(state, xs):
        w_n, kd_n, u_n, d_n = xs
        state_b = state.astype(u.dtype)
        v_new = u_n.astype(_F32) - mm("bhck,bhkv->bhcv", w_n, state_b)
        new = d_n[..., None] * state + mm("bhck,bhcv->bhkv", kd_n, v_new.astype(u.dtype))
        return new, (state_b, v_new.astype(u.dtype))

    final, (states, v_new) = lax.scan(step, initial_state, (split(w), split(kd), split(u), split(d)))
    merge = lambda x: x.swapaxes(0, 1).reshape(chunks, *x.shape[2:])  # noqa: E731
    return final, merge(states), merge(v_new)
