"""Gated multi-head latent attention (MLA), DESIGN §3.2.

DeepSeek-style latent attention: keys and values are expanded from a low-rank latent `c_kv` plus
one key part `k_shared` shared by all heads, so a decoding cache holds only `(c_kv, k_shared)`.
NoPE by default (the KDA layers carry position); RoPE on the shared/rope parts is an ablation.
The attention itself goes through a backend table; every backend must honour the document mask.
Under a mesh whose "length" rule splits positions, the latent is all-gathered over the sequence shards and
each shard attends its own queries (hybridmoe.context_parallel; the "xla" backend, which takes a query offset).
"""

from __future__ import annotations

import functools
from typing import Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridmoe import context_parallel
from hybridmoe.config import MLAConfig
from hybridmoe.layers.common import Dense, RMSNorm, fan_in_init, param_with_axes


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its document: restarts at 0 where segment_ids changes.

    segment_ids: [B, T] int -> [B, T] int32.
    """
    t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], dtype=bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
        axis=1)
    start_index = jax.lax.cummax(jnp.where(starts, t[None, :], 0), axis=1)
    return t[None, :] - start_index


def apply_rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embedding, half-split layout, computed in fp32.

    x: [B, T, ..., D] (D even), positions: [B, T] -> same shape and dtype as x.
    """
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + (half,))
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# Above this many logits per (batch row, head) the XLA path walks the queries in blocks, so that the
# [B, H, T, S] fp32 logits never exist at once (64K x 64K would be 16 GiB per head).
QUERY_BLOCK = 2048
QUERY_BLOCK_MIN_LOGITS = 2 ** 26


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
                  scale: float, *, kv_segment_ids: jax.Array | None = None,
                  q_offset: int | jax.Array = 0, query_block: int | None = None) -> jax.Array:
    """Causal softmax attention with a same-document mask; logits and softmax in fp32.

    q: [B, T, H, Dqk], k: [B, S, H, Dqk], v: [B, S, H, Dv], segment_ids: [B, T] | None
    -> [B, T, H, Dv] in v's dtype. Query t sits at key position q_offset + t: the queries may be one
    sequence shard's (context parallelism), with kv_segment_ids [B, S] the keys' ids (default: segment_ids).
    query_block: compute the queries in blocks of this many rows, one after another (the same
    numbers, less memory); a length that is not a multiple is padded with rows whose outputs are
    dropped. Default QUERY_BLOCK once T·S reaches QUERY_BLOCK_MIN_LOGITS.
    """
    t, s = q.shape[1], k.shape[1]
    if query_block is None and t * s >= QUERY_BLOCK_MIN_LOGITS:
        query_block = QUERY_BLOCK
    if query_block is not None and query_block < 1:
        raise ValueError(f"xla_attention.query_block must be a positive number of rows, got {query_block}")
    if query_block is not None and query_block < t:
        kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        blocks = -(-t // query_block)
        pad = blocks * query_block - t
        # Padded rows repeat the last query and its document id: every one keeps a visible key.
        q_p = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)), mode="edge") if pad else q
        ids_p = (None if segment_ids is None
                 else jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge") if pad else segment_ids)

        def block(i):
            start = i * query_block
            q_i = jax.lax.dynamic_slice_in_dim(q_p, start, query_block, axis=1)
            ids_i = (None if ids_p is None
                     else jax.lax.dynamic_slice_in_dim(ids_p, start, query_block, axis=1))
            return _attend(q_i, k, v, ids_i, scale, kv_ids, q_offset + start)

        # Each block is rematerialised: the backward keeps one block's logits at a time instead of
        # every block's softmax (which together are the whole [T, S] matrix again).
        out = jax.lax.map(jax.checkpoint(block), jnp.arange(blocks))  # [N, B, block, H, Dv]
        out = jnp.moveaxis(out, 0, 1).reshape(q.shape[:1] + (blocks * query_block,) + out.shape[-2:])
        return out[:, :t]
    return _attend(q, k, v, segment_ids, scale, kv_segment_ids, q_offset)


def _attend(q, k, v, segment_ids, scale, kv_segment_ids, q_offset):
    t, s = q.shape[1], k.shape[1]
    logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    mask = (q_offset + jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None, None]
    if segment_ids is not None:
        kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    # The diagonal is never masked, so every row keeps at least one finite logit.
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v,
                      preferred_element_type=jnp.float32).astype(v.dtype)


# backend name -> attention function with xla_attention's signature. "cudnn" and "pallas" are
# registered by their own modules once they exist; until then asking for them is an error.
ATTENTION_BACKENDS: dict[str, Callable[..., jax.Array]] = {"xla": xla_attention}


def attention_backend(name: str) -> Callable[..., jax.Array]:
    if name not in ATTENTION_BACKENDS:
        available = ", ".join(repr(b) for b in sorted(ATTENTION_BACKENDS))
        raise ValueError(f"MLAConfig.backend={name!r} is not available in this build; use {available}")
    return ATTENTION_BACKENDS[name]


class MLA(nn.Module):
    """Gated multi-head latent attention: x [B, T, d] -> [B, T, d]."""

    config: MLAConfig
    d_model: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    norm_eps: float = 1e-6

    def setup(self):
        cfg = self.config
        h, dqk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        norm_kw = dict(eps=self.norm_eps, **kw)
        if cfg.q_lora_rank:
            self.wq_a = Dense(cfg.q_lora_rank, ("embed", "q_lora"), **kw)
            self.q_norm = RMSNorm(**norm_kw)
            self.wq_b = Dense((h, dqk), ("q_lora", "heads", "head_dim"), **kw)
        else:
            self.wq = Dense((h, dqk), ("embed", "heads", "head_dim"), **kw)
        self.wkv_a = Dense(cfg.kv_lora_rank + cfg.qk_rope_head_dim, ("embed", "kv_lora"), **kw)
        self.kv_norm = RMSNorm(**norm_kw)
        self.wkv_b = Dense((h, cfg.qk_nope_head_dim + cfg.v_head_dim),
                           ("kv_lora", "heads", "head_dim"), **kw)
        if cfg.output_gate:
            self.w_gate = Dense((h, cfg.v_head_dim), ("embed", "heads", "head_dim"), **kw)
        self.wo = param_with_axes(self, "wo", fan_in_init(h * cfg.v_head_dim),
                                  (h, cfg.v_head_dim, self.d_model), ("heads", "head_dim", "embed"),
                                  self.param_dtype)

    def latent_kv(self, x: jax.Array, positions: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """What a decoding cache stores. x: [B, T, d] -> c_kv [B, T, R] (normed), k_shared [B, T, Dr]."""
        cfg = self.config
        c_kv, k_shared = jnp.split(self.wkv_a(x), [cfg.kv_lora_rank], axis=-1)
        if cfg.use_rope:
            k_shared = apply_rope(k_shared, positions, cfg.rope_base)
        return self.kv_norm(c_kv), k_shared

    def expand_kv(self, c_kv: jax.Array, k_shared: jax.Array) -> tuple[jax.Array, jax.Array]:
        """c_kv [B, S, R], k_shared [B, S, Dr] -> keys [B, S, H, Dn+Dr], values [B, S, H, Dv]."""
        cfg = self.config
        k_nope, v = jnp.split(self.wkv_b(c_kv), [cfg.qk_nope_head_dim], axis=-1)
        shared = jnp.broadcast_to(k_shared[:, :, None, :],
                                  k_nope.shape[:3] + (cfg.qk_rope_head_dim,))
        return jnp.concatenate([k_nope, shared.astype(k_nope.dtype)], axis=-1), v

    def queries(self, x: jax.Array, positions: jax.Array | None) -> jax.Array:
        """x: [B, T, d] -> q [B, T, H, Dn+Dr]; RoPE on the last Dr channels when use_rope."""
        cfg = self.config
        q = self.wq_b(self.q_norm(self.wq_a(x))) if cfg.q_lora_rank else self.wq(x)
        if cfg.use_rope:
            q_nope, q_rope = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
            q = jnp.concatenate([q_nope, apply_rope(q_rope, positions, cfg.rope_base)], axis=-1)
        return q

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        """x: [B, T, d]; segment_ids, positions: [B, T] int or None -> [B, T, d].

        Tokens attend causally within their own segment. Positions matter only with use_rope; by default
        they count from 0 at the start of each segment (or of the row without segment_ids).
        """
        cfg = self.config
        chex.assert_rank(x, 3)
        chex.assert_axis_dimension(x, 2, self.d_model)
        b, t, _ = x.shape
        for name, arr in (("segment_ids", segment_ids), ("positions", positions)):
            if arr is not None:
                chex.assert_shape(arr, (b, t), custom_message=f"MLA {name}")
        attend = attention_backend(cfg.backend)
        if cfg.backend == "cudnn":
            attend = functools.partial(attend, max_segments=cfg.max_segments)
        if cfg.use_rope and positions is None:
            positions = (positions_from_segments(segment_ids) if segment_ids is not None
                         else jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))

        q = self.queries(x, positions)
        latent = self.latent_kv(x, positions)
        scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        # init only creates parameters, which cannot happen inside the shard_map
        parallel = None if self.is_initializing() else context_parallel.current()
        if parallel is None:
            out = attend(q, *self.expand_kv(*latent), segment_ids, scale)  # [B, T, H, Dv]
        else:
            out = self._sharded_attention(parallel, q, latent, segment_ids, scale)
        if cfg.output_gate:
            gate = jax.nn.sigmoid(self.w_gate(x).astype(jnp.float32))
            out = (out.astype(jnp.float32) * gate).astype(self.dtype)
        return jnp.einsum("bthv,hvd->btd", out, self.wo.astype(self.dtype))

    def _sharded_attention(self, parallel: context_parallel.ContextParallel, q: jax.Array,
                           latent: tuple[jax.Array, jax.Array], segment_ids: jax.Array | None,
                           scale: float) -> jax.Array:
        """Attention over sequence shards from the all-gathered latent; needs a backend with a query offset."""
        if self.config.backend != "xla":
            raise ValueError(f"MLAConfig.backend={self.config.backend!r} takes no query offset, which "
                             f"context parallelism over {parallel.describe()} needs; use "
                             f"MLAConfig.backend='xla'")
        attend = functools.partial(xla_attention, scale=scale)
        return context_parallel.latent_attention(parallel, attend, self.expand_kv, q, *latent, segment_ids)
