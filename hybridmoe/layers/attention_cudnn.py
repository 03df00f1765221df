"""cuDNN flash attention for MLA, with packed documents (DESIGN §2, §3.2).

`jax.nn.dot_product_attention(implementation="cudnn")` takes no segment ids, and a mask argument
would be a dense [B, H, T, T] tensor, which defeats flash attention at long T. cuDNN's packed
("ragged") layout does what we need: each row is a list of segments given by their start offsets
and lengths, and the causal mask applies inside each segment. JAX exposes it only through its
internal wrapper `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` (q/kv offsets),
which is why the JAX version is pinned and why packing isolation is tested on the GPU
(`experiments/verify_attention.py`), not assumed.

The number of segments per row must be static for cuDNN. `max_segments` bounds it; a row with more
documents than that cannot be expressed, and its output is NaN rather than silently attending across
documents (the train loop's non-finite guard then stops the run with a message).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DEFAULT_MAX_SEGMENTS = 256


def packed_segments(segment_ids: jax.Array, max_segments: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Segment ids [B, T] -> (seqlen [B, M], offsets [B, M+1], overflow [B]) in cuDNN's packed form.

    A segment starts wherever the id changes (and at t = 0). Row b's m-th segment starts at
    offsets[b, m] and has seqlen[b, m] tokens; every unused entry is -1, including the last column
    of offsets (JAX's wrapper flattens the non-negative entries of all rows into one list of segment
    starts, so a closing offset per row would shift every later row's starts by one segment).
    overflow[b] is True when the row has more than M segments.
    """
    b, t = segment_ids.shape
    m = max_segments
    starts = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    rank = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # segment index of each token
    count = rank[:, -1] + 1  # [B]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    slot = jnp.where(starts, rank, m + 1)  # non-starts go to a slot that is dropped
    start_at = jnp.full((b, m + 1), -1, jnp.int32).at[rows, slot].set(positions, mode="drop")
    used = jnp.arange(m)[None, :] < jnp.minimum(count, m)[:, None]  # [B, M]
    # A segment ends where the next one starts, the row's last one at T.
    ends = jnp.where(jnp.arange(1, m + 1)[None, :] < count[:, None], start_at[:, 1:], t)
    seqlen = jnp.where(used, ends - start_at[:, :-1], -1)
    offsets = jnp.concatenate([jnp.where(used, start_at[:, :-1], -1),
                               jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return seqlen, offsets, count > m


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
                    scale: float, max_segments: int = DEFAULT_MAX_SEGMENTS) -> jax.Array:
    """Causal attention inside each document through cuDNN; `xla_attention`'s signature.

    q, k: [B, T, H, Dqk], v: [B, T, H, Dv] in bf16 or fp16 (Dqk != Dv needs cuDNN >= 9.10 on
    Hopper); segment_ids [B, T] or None -> [B, T, H, Dv].
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"MLAConfig.backend='cudnn' needs bf16 or fp16 activations, got {q.dtype}; "
                         "use ModelConfig.dtype='bfloat16' or MLAConfig.backend='xla'")
    if segment_ids is None:
        return cudnn_fa.dot_product_attention(q, k, v, scale=scale,
                                              mask_type=cudnn_fa.MaskType.CAUSAL)
    seqlen, offsets, overflow = packed_segments(segment_ids, max_segments)
    # The wrapper turns token offsets into element offsets with K's per-token stride (heads x
    # Dqk) and uses them for V as well, so packed V must have K's head width: pad the narrower of
    # the two with zeros (zero q/k columns add nothing to the logits; zero v columns are cut off).
    q, k, v, dv = pad_head_dims(q, k, v)
    out = cudnn_fa.dot_product_attention(
        q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
        scale=scale, mask_type=cudnn_fa.MaskType.PADDING_CAUSAL)[..., :dv]
    return jnp.where(overflow[:, None, None, None], jnp.nan, out).astype(out.dtype)


def pad_head_dims(q: jax.Array, k: jax.Array, v: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """Zero-pads q, k [.., Dqk] and v [.., Dv] to one head width max(Dqk, Dv); returns Dv too."""
    dqk, dv = q.shape[-1], v.shape[-1]
    width = max(dqk, dv)

    def pad(x):
        extra = width - x.shape[-1]
        return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])

    return pad(q), pad(k), pad(v), dv


def register() -> None:
    """Adds "cudnn" to the MLA backend table (idempotent)."""
    from hybridmoe.layers import mla
    mla.ATTENTION_BACKENDS.setdefault("cudnn", functools.partial(cudnn_attention))
