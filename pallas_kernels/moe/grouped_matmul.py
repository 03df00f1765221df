"""Grouped (ragged) matrix product for dropless MoE dispatch, differentiable (DESIGN §3.3).

    grouped_matmul(x_sorted [M, K], w [G, K, N], group_sizes [G]) -> [M, N]

Rows of x_sorted are sorted by group: rows [s_g, s_g + group_sizes[g]) use w[g]. Rows at or past
sum(group_sizes) belong to no group and come out as ZERO (also in the input gradient), so inactive
assignments can be parked at the end. The backward is

    dx = ragged_dot(dy, w, transpose_rhs=True)    [M, K]   (contract N)
    dw = transposed_ragged_dot(x_sorted, dy)      [G, K, N] (contract the rows of each group)

Backends:
  "mosaic_gpu": JAX 0.11.2's Mosaic GPU kernels (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` and
      `transposed_ragged_dot_mgpu`), Hopper only (wgmma), bf16/f16 operands, fp32 accumulation. The forward
      and dx kernel comes in two group lookups: "unrolled" is the stock kernel, which finds each output tile's
      group by an unrolled loop over all G groups inside the kernel (cost grows with G); "table" (default) is
      the same kernel reading a per-tile (group, block, start, end) table computed once outside by XLA.
  "reference": `jax.lax.ragged_dot` / `ragged_dot_general` through the SAME custom_vjp; exact on CPU.
      On the GPU XLA expands it to a zero-padded dense product (10.9 TFLOP/s measured on the H200): never the
      GPU hot path.
  "auto": mosaic_gpu where `mosaic_supported(...)` holds, else reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

# Fallback SM count when no GPU is attached (cross-lowering on a CPU host); the H100/H200 SXM have 132.
_DEFAULT_NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tiles of one Mosaic GPU kernel: output tile block_m x block_n, contraction step block_k."""

    block_m: int = 192
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 4

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """forward: tiles of the forward and of dx; weight_grad: tiles of dw (transposed kernel)."""

    forward: TileConfig = TileConfig()
    weight_grad: TileConfig = TileConfig(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
                                         grid_block_n=4)
    group_lookup: str = "table"  # "table" | "unrolled"
    backend: str = "auto"  # "auto" | "mosaic_gpu" | "reference"

    def __post_init__(self):
        if self.group_lookup not in ("table", "unrolled"):
            raise ValueError(f"group_lookup must be 'table' or 'unrolled', got {self.group_lookup!r}")
        if self.backend not in ("auto", "mosaic_gpu", "reference"):
            raise ValueError(f"backend must be 'auto', 'mosaic_gpu' or 'reference', got {self.backend!r}")


DEFAULT_CONFIG = GroupedMatmulConfig()


# ----------------------------------------------------------------------------------------------------------
# Backend choice


def _on_hopper_gpu() -> bool:
    if jax.default_backend() != "gpu":
        return False
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if cc is not None:
        return str(cc).split(".")[0] == "9"
    return any(name in str(getattr(dev, "device_kind", "")) for name in ("H100", "H200", "H800", "H20"))


def mosaic_supported(dtype, k: int, n: int, config: GroupedMatmulConfig = DEFAULT_CONFIG,
                     *, check_device: bool = True) -> bool:
    """Whether the Mosaic GPU kernels take x [M, k] @ w [G, k, n] in `dtype` (forward, dx and dw tiles)."""
    f, wg = config.forward, config.weight_grad
    shapes_ok = (k % f.block_k == 0 and n % f.block_n == 0  # forward
                 and n % f.block_k == 0 and k % f.block_n == 0  # dx: contract n, produce k
                 and k % wg.block_m == 0 and n % wg.block_n == 0)  # dw: [G, k, n]
    dtype_ok = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return shapes_ok and dtype_ok and (not check_device or _on_hopper_gpu())


def _resolve_backend(config: GroupedMatmulConfig, dtype, k: int, n: int) -> str:
    if config.backend == "reference":
        return "reference"
    if config.backend == "mosaic_gpu":
        if not mosaic_supported(dtype, k, n, config, check_device=False):
            raise ValueError(f"grouped_matmul: backend 'mosaic_gpu' needs bf16/f16 operands and K={k}, N={n} "
                             f"divisible by the tiles of {config}")
        return "mosaic_gpu"
    return "mosaic_gpu" if mosaic_supported(dtype, k, n, config) else "reference"


# ----------------------------------------------------------------------------------------------------------
# Reference primitives (any backend)


def _ref_forward(x, w, group_sizes):
    return lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def _ref_dx(dy, w, group_sizes):
    return lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), group_sizes,
                          preferred_element_type=jnp.float32).astype(dy.dtype)


def _ref_dw(x, dy, group_sizes):
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return lax.ragged_dot_general(x, dy, group_sizes, dims,
                                  preferred_element_type=jnp.float32).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Mosaic GPU primitives


def tile_table(group_sizes: jax.Array, block_m: int, m: int) -> tuple[jax.Array, ...]:
    """Per output-row tile of the forward kernel: (group id, row block, group start, group end), int32 [T].

    T = cdiv(m, block_m) + G - 1 tiles, enumerated group by group exactly as the stock kernel's
    `GroupInfo.create` does (a tile that straddles a group boundary is visited once per group); a tile
    that belongs to no group gets (0, 0, 0, 0) and stores nothing.
    """
    g = group_sizes.shape[0]
    num_tiles = -(-m // block_m) + g - 1
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    idx = jnp.arange(g, dtype=jnp.int32)
    start_block = lax.div(starts, jnp.int32(block_m))
    final_block = lax.div(ends - 1, jnp.int32(block_m))  # truncating, as in the stock kernel
    tid_begin = start_block + idx
    tid_end = final_block + 1 + idx
    t = jnp.arange(num_tiles, dtype=jnp.int32)[:, None]
    match = (tid_begin[None, :] <= t) & (t < tid_end[None, :])
    gid = jnp.max(jnp.where(match, idx[None, :], -1), axis=1)
    hit = gid >= 0
    gid = jnp.where(hit, gid, 0)
    t = t[:, 0]
    block = jnp.where(hit, t - tid_begin[gid] + start_block[gid], 0)
    return (gid, block.astype(jnp.int32), jnp.where(hit, starts[gid], 0), jnp.where(hit, ends[gid], 0))


def _num_sms() -> int:
    try:
        dev = jax.devices()[0]
        return int(getattr(dev, "core_count", 0)) if dev.platform == "gpu" else _DEFAULT_NUM_SMS
    except Exception:  # noqa: BLE001 - no device query possible: lowering for another platform
        return _DEFAULT_NUM_SMS


def _ragged_dot_table(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps,
                      grid_block_n, transpose_rhs=False):
    """The stock `ragged_dot_mgpu.ragged_dot` kernel with the per-tile group lookup read from a table.

    Adapted from jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py (JAX 0.11.2, Apache-2.0).
    """
    import math
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import GroupInfo

    if lhs.dtype != rhs.dtype:
        raise NotImplementedError(f"lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}")
    m, k = lhs.shape
    g, k2, n = rhs.shape
    if transpose_rhs:
        k2, n = n, k2
    if k != k2:
        raise ValueError(f"lhs.shape={k} must match rhs.shape={k2}")
    if k % block_k != 0:
        raise ValueError(f"k={k} must be a multiple of block_k={block_k}")
    tables = tile_table(group_sizes, block_m, m)
    grid_m = tables[0].shape[0]

    def body(tile_group, tile_block, tile_start, tile_end, lhs_gmem, rhs_gmem, o_gmem):
        grid_n = pl.cdiv(n, block_n)

        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def mn_loop(loop_info: plgpu.NDLoopInfo):
            mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, grid_block_n)
            tile = jnp.int32(block_m)
            group_id, block = tile_group[mi], tile_block[mi]
            group_start, group_end = tile_start[mi], tile_end[mi]
            block_start = block * tile
            actual_start = jnp.maximum(group_start, block_start)
            actual_end = jnp.minimum(group_end, block_start + tile)
            info = GroupInfo(group_id=group_id, block=block, block_start=block_start,
                             actual_start=actual_start, actual_end=actual_end,
                             start_within_block=actual_start - block_start,
                             actual_size=actual_end - actual_start)

            def acc_scope(acc_ref):
                plgpu.emit_pipeline(
                    lambda _, lhs_smem, rhs_smem: plgpu.wgmma(
                        acc_ref, lhs_smem, rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem),
                    grid=(k // block_k,),
                    in_specs=[
                        plgpu.BlockSpec((block_m, block_k), lambda kk: (info.block, kk), delay_release=1),
                        plgpu.BlockSpec((block_n, block_k) if transpose_rhs else (block_k, block_n),
                                        lambda kk: (ni, kk) if transpose_rhs else (kk, ni), delay_release=1),
                    ],
                    max_concurrent_steps=max_concurrent_steps,
                )(lhs_gmem, rhs_gmem.at[info.group_id])
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), dtype=o_gmem.dtype))
            def store_scope(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                smem_start = info.start_within_block
                remaining_rows = min(block_m, m)
                # Store the tile's rows of this group with a ladder of power-of-two TMA stores (see stock kernel).
                while remaining_rows > 0:
                    const_rows_len = 1 << int(math.log2(remaining_rows))
                    remaining_rows //= 2

                    @pl.when(info.actual_size & const_rows_len != 0)
                    def _():
                        plgpu.copy_smem_to_gmem(
                            o_smem.at[pl.ds(smem_start, const_rows_len)],
                            o_gmem.at[pl.ds(info.block_start + smem_start, const_rows_len),
                                      pl.ds(ni * block_n, block_n)])

                    smem_start += info.actual_size & const_rows_len
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(*tables, lhs, rhs)


def _mgpu_matmul(lhs, rhs, group_sizes, config: GroupedMatmulConfig, transpose_rhs: bool):
    if config.group_lookup == "table":
        return _ragged_dot_table(lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs,
                                 **config.forward.kwargs())
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs,
                                      **config.forward.kwargs())


# The kernels' TMA tiling needs the row count (M) to be a multiple of 8 (a lowering error otherwise, seen on the
# H200 with M = 850): pad with zero rows, which lie past every group.
_ROW_MULTIPLE = 8


def _pad_rows(a):
    pad = -a.shape[0] % _ROW_MULTIPLE
    return a if pad == 0 else jnp.pad(a, ((0, pad), (0, 0)))


def _mgpu_forward(x, w, group_sizes, config):
    return _mgpu_matmul(_pad_rows(x), w, group_sizes, config, transpose_rhs=False)[:x.shape[0]]


def _mgpu_dx(dy, w, group_sizes, config):
    return _mgpu_matmul(_pad_rows(dy), w, group_sizes, config, transpose_rhs=True)[:dy.shape[0]]


def _mgpu_dw(x, dy, group_sizes, config):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(_pad_rows(x), _pad_rows(dy), group_sizes=group_sizes,
                                                            **config.weight_grad.kwargs())


# ----------------------------------------------------------------------------------------------------------
# The differentiable op


def _zero_tail(y, group_sizes):
    """Rows at or past sum(group_sizes) -> 0 (the kernels leave them unwritten)."""
    valid = jnp.arange(y.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes, dtype=jnp.int32)
    return jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))


def _ops(backend: str):
    if backend == "reference":
        return (lambda x, w, gs, c: _ref_forward(x, w, gs), lambda dy, w, gs, c: _ref_dx(dy, w, gs),
                lambda x, dy, gs, c: _ref_dw(x, dy, gs))
    return _mgpu_forward, _mgpu_dx, _mgpu_dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x, w, group_sizes, backend, config):
    fwd, _, _ = _ops(backend)
    return _zero_tail(fwd(x, w, group_sizes, config), group_sizes)


def _grouped_fwd(x, w, group_sizes, backend, config):
    return _grouped(x, w, group_sizes, backend, config), (x, w, group_sizes)


def _grouped_bwd(backend, config, res, dy):
    x, w, group_sizes = res
    _, dx_op, dw_op = _ops(backend)
    dy = _zero_tail(dy.astype(x.dtype), group_sizes)  # no group's rows: no gradient (and no NaN passes)
    dx = _zero_tail(dx_op(dy, w, group_sizes, config), group_sizes)
    dw = dw_op(x, dy, group_sizes, config).astype(w.dtype)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   config: GroupedMatmulConfig | None = None) -> jax.Array:
    """x_sorted [M, K] (rows sorted by group) @ w [G, K, N] per group -> [M, N] in x_sorted's dtype.

    w is cast to x_sorted's dtype (the gradient flows back to w's own dtype). group_sizes [G] int; rows
    at or past sum(group_sizes) give zero rows. Differentiable in x_sorted and w.
    """
    config = config or DEFAULT_CONFIG
    if x_sorted.ndim != 2 or w.ndim != 3 or x_sorted.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul: x_sorted [M, K] and w [G, K, N] expected, got {x_sorted.shape} "
                         f"and {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_matmul: group_sizes must have shape ({w.shape[0]},), got {group_sizes.shape}")
    backend = _resolve_backend(config, x_sorted.dtype, w.shape[1], w.shape[2])
    return _grouped(x_sorted, w.astype(x_sorted.dtype), group_sizes.astype(jnp.int32), backend, config)


def grouped_matmul_dense_reference(x_sorted, w, group_sizes):
    """Oracle: a Python loop over groups of dense products (fp32), zero rows past the last group."""
    sizes = [int(s) for s in group_sizes]
    x32, w32 = x_sorted.astype(jnp.float32), w.astype(jnp.float32)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    parts = [x32[s:s + size] @ w32[gi] for gi, (s, size) in enumerate(zip(starts, sizes))]
    tail = jnp.zeros((x_sorted.shape[0] - sum(sizes), w.shape[2]), jnp.float32)
    return jnp.concatenate(parts + [tail], axis=0)


# ----------------------------------------------------------------------------------------------------------
# Row permutations for dispatch with gather-only backward passes


@jax.custom_vjp
def expand_sorted(x, token_of_row, row_of_assignment):
    """x [N, d] -> x_sorted [N·k, d] = x[token_of_row]; row_of_assignment [N·k] is the inverse permutation
    (sorted row of assignment a = token·k + slot). Backward: dx[t] = sum over slots of dx_sorted at the
    token's k rows (a gather and a sum, no scatter)."""
    return jnp.take(x, token_of_row, axis=0)


def _expand_fwd(x, token_of_row, row_of_assignment):
    # A [N, 0] array carries x's row count and dtype into the backward.
    return expand_sorted(x, token_of_row, row_of_assignment), (row_of_assignment, x[:, :0])


def _expand_bwd(res, dxs):
    row_of_assignment, x_empty = res
    n = x_empty.shape[0]
    k = row_of_assignment.shape[0] // n
    dx = jnp.take(dxs, row_of_assignment, axis=0).reshape(n, k, -1).astype(jnp.float32).sum(1)
    return dx.astype(x_empty.dtype), None, None


expand_sorted.defvjp(_expand_fwd, _expand_bwd)


@jax.custom_vjp
def permute_rows(y, index, inverse):
    """y[index] for a permutation `index` with inverse `inverse`; backward is the gather by `inverse`."""
    return jnp.take(y, index, axis=0)


def _permute_fwd(y, index, inverse):
    return permute_rows(y, index, inverse), inverse


def _permute_bwd(inverse, dy):
    return jnp.take(dy, inverse, axis=0), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)
