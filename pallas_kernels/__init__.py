"""Kernels next to their references: `kda/` (chunked Kimi Delta Attention with a bounded decay), `moe/`
(grouped expert GEMM for dropless dispatch), `attn_res/` (the Block AttnRes depth mix, fused)."""
