"""MLA's attention on TPU, with packed documents (DESIGN §2, §3.2, §3.6).

Two Mosaic TPU kernels. Up to SPLASH_MAX_LENGTH tokens, JAX's splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`): a static block-sparse mask (causal here) ANDed with
segment ids, fully masked key blocks skipped. Its mask tables are built on the host, one entry per block pair,
so at 256K and beyond they take minutes to build and outgrow the core's scalar memory; longer rows go to
`pallas_kernels.attention.flash_tpu`, whose masks come from indices and whose block skipping follows the
documents as well as causality.

MLAConfig.backend "pallas" picks between them by length; "pallas_flash" is always the index-masked kernel;
the "_interpret" forms run Pallas' TPU interpreter on any platform (the CPU tests). Query and key head widths
may differ from the value width (MLA's 192 / 128). Lowered for TPU targets, not compiled by a TPU or timed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention.flash_tpu import flash_attention

BLOCK = 512  # query / key tile (smaller rows are padded up to a multiple of 128)
SPLASH_MAX_LENGTH = 65536  # longest row given to splash (lowered at 8K and 64K; 256K took minutes to build)


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


def tpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, scale: float, *,
                  interpret: bool = False) -> jax.Array:
    """Splash attention up to SPLASH_MAX_LENGTH tokens, the index-masked flash kernel beyond."""
    attend = splash_attention if q.shape[1] <= SPLASH_MAX_LENGTH else flash_attention
    return attend(q, k, v, segment_ids, scale, interpret=interpret)


def register() -> None:
    """Adds "pallas", "pallas_flash" and their "_interpret" forms to the MLA backend table (idempotent)."""
    from hybridmoe.layers import mla
    for name, attend in (("pallas", tpu_attention), ("pallas_flash", flash_attention)):
        mla.ATTENTION_BACKENDS.setdefault(name, attend)
        mla.ATTENTION_BACKENDS.setdefault(f"{name}_interpret", functools.partial(attend, interpret=True))

