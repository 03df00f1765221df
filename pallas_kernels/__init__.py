"""Kernels next to their references: `kda/` (chunked Kimi Delta Attention with a bounded decay)."""
