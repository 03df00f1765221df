"""Pallas splash attention for MLA on TPU, with packed documents (DESIGN §2, §3.2).

JAX's Mosaic TPU splash-attention kernels (`jax.experimental.pallas.ops.tpu.splash_attention`) take a
static block-sparse mask (causal here) and segment ids, which they AND with it, so packed documents never
attend to each other; fully masked key blocks are skipped, so causal attention costs half the blocks.
Registered as MLAConfig.backend "pallas" (Mosaic TPU) and "pallas_interpret" (Pallas' TPU interpreter on
any platform: the CPU tests). Query and key head widths may differ from the value width (MLA's 192 / 128).
Not yet compiled or timed on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK = 512  # query / key tile (smaller rows are padded up to a multiple of 128)


def _tile(t: int) -> tuple[int, int]:
    """(padded length, tile): T rounded up to 128, and the largest tile <= BLOCK that divides it."""
    padded = -(-t // 128) * 128
    tile = max(b for b in (128, 256, 512) if b <= BLOCK and padded % b == 0)
    return padded, tile


@functools.lru_cache(maxsize=16)
def _kernel(heads: int, t: int, tile: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    mask = masks.MultiHeadMask([masks.CausalMask((t, t)) for _ in range(heads)])
    sizes = splash.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile,
                              block_kv_dkv=tile, block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
                     scale: float, *, interpret: bool = False) -> jax.Array:
    """Causal attention inside each document; `xla_attention`'s signature.

    q, k: [B, T, H, Dqk], v: [B, T, H, Dv]; segment_ids [B, T] or None -> [B, T, H, Dv] in v's dtype.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    b, t, h, _ = q.shape
    padded, tile = _tile(t)
    pad = padded - t
    if segment_ids is None:
        segment_ids = jnp.zeros((b, t), jnp.int32)
    # Padded tokens form their own document (-1), after the last real one: causality and the ids keep
    # them out of every real output, and each padded query still sees itself (no empty softmax row).
    segment_ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    heads_first = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0)))  # noqa: E731
    kernel = _kernel(h, padded, tile, interpret)

    def one_row(q, k, v, ids):
        return kernel(q, k, v, segment_ids=splash.SegmentIds(q=ids, kv=ids))

    out = jax.vmap(one_row)(heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v),
                            segment_ids)
    return jnp.swapaxes(out[:, :, :t], 1, 2).astype(v.dtype)


def register() -> None:
    """Adds "pallas" and "pallas_interpret" to the MLA backend table (idempotent)."""
    from hybridmoe.layers import mla
    mla.ATTENTION_BACKENDS.setdefault("pallas", splash_attention)
    mla.ATTENTION_BACKENDS.setdefault("pallas_interpret", functools.partial(splash_attention, interpret=True))

