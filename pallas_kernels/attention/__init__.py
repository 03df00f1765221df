"""Attention kernels: causal flash attention over packed documents for Mosaic TPU (flash_tpu)."""
