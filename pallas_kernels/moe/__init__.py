"""Grouped GEMM for dropless MoE dispatch (DESIGN §3.3): JAX's Mosaic GPU ragged-dot kernels on Hopper, with a
custom VJP (dx and dw through the same kernel family), and `jax.lax.ragged_dot` as the reference elsewhere."""

from pallas_kernels.moe.grouped_matmul import (DEFAULT_CONFIG, GroupedMatmulConfig, TileConfig, expand_sorted,
                                               grouped_matmul, grouped_matmul_dense_reference, mosaic_supported,
                                               permute_rows, tile_table)

__all__ = ["DEFAULT_CONFIG", "GroupedMatmulConfig", "TileConfig", "expand_sorted", "grouped_matmul",
           "grouped_matmul_dense_reference", "mosaic_supported", "permute_rows", "tile_table"]
