"""Attention residuals' depth mix (DESIGN §3.4) as one fused kernel forward and one backward per site.

    out = attn_res_mix_fused(sources, key_norm_scale * query, eps)

The reference is `hybridmoe.layers.attn_res.attn_res_mix` with impl="xla".
"""

from pallas_kernels.attn_res.mix import attn_res_mix_fused, default_block_rows, is_supported

__all__ = ["attn_res_mix_fused", "default_block_rows", "is_supported"]
