"""Context parallelism (DESIGN §3.7): the sequence-mixing ops of KDA and MLA on sequence shards.

When the "length" rule maps positions to mesh axes of size > 1 (DEFAULT_RULES: `sequence`), every row's T
tokens are split into n consecutive shards of L = T/n. Everything per token (projections, norms, gates, MoE,
AttnRes) needs nothing from other shards; the three ops that mix positions run inside `jax.shard_map`, manual
over the sequence axes only (batch, FSDP, tensor axes stay automatic), and exchange this much per layer:

- Short causal convolution (KDA's q, k, v; width W): each shard receives the previous shard's last W-1 tokens
  and their segment ids by one `ppermute` (shard 0 receives zeros: the convolution's zero padding), runs the
  ordinary convolution on [halo | own tokens] and keeps its own outputs. Volume: (W-1)·C values per row.
- KDA: state passing. Per head the recurrence is affine in the state, S_t = A_t S_{t-1} + β_t k_t v_tᵀ with
  A_t = (I - β_t k_t k_tᵀ) Diag(e^{g_t}) acting on each value column alike, so a shard maps its incoming state
  E to S_end = M E + S⁰ (M = A_L···A_1, K×K; S⁰ the final state from a zero start) and its outputs to
  o_t = o⁰_t + Eᵀ (P_tᵀ q_t) (P_t = A_t···A_1). One chunked scan on the shard's tokens with V+K value columns,
  values [v | 0] from the state [0 | I], yields all four: o⁰, P_tᵀ q_t, S⁰ and M (the scan's value-side work
  grows from V to V+K columns; no second pass). One `all_gather` of [S⁰ | M] — K×(V+K) fp32 per value head per
  shard — and of each shard's first and last segment id; then every shard composes the prefix
  E_{i+1} = M_i E_i + S⁰_i (n small matmuls) and adds the correction. Documents: a start inside a shard zeroes
  M (chunk_kda seeds only the first document from the initial state); a start at a shard's first token zeroes
  the state entering that shard.
- MLA: one `all_gather` of the latent [c_kv | k_shared] (kv_lora_rank + qk_rope_head_dim values per token,
  instead of H·(d_qk + d_v) for keys and values) and of the segment ids; each shard expands keys and values
  for the whole row and attends its L queries with the causal offset i·L. Logits are [B, H, L, T] per shard.

Without a sequence axis (`current()` is None) the layers run their single-device code unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hybridmoe.sharding import axis_sizes, mesh_axes
from pallas_kernels.kda import chunk_kda

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The mesh axes that split positions (the "length" rule's axes of size > 1) and their total size."""

    axes: tuple[str, ...]
    size: int

    def describe(self) -> str:
        """'sequence=8', or 'a×b=8' when the rule names several axes."""
        return "×".join(self.axes) + f"={self.size}"

    def shard_length(self, seq_len: int) -> int:
        """Tokens per shard; every row's length must split evenly."""
        if seq_len % self.size:
            raise ValueError(f"sequence length {seq_len} must be a multiple of the mesh's sequence axes "
                             f"{self.describe()} (context parallelism splits every row evenly)")
        return seq_len // self.size

    def shard(self, fn: Callable, in_specs: tuple, out_specs) -> Callable:
        """fn runs on each shard's tokens; manual over the sequence axes only."""
        return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset(self.axes),
                             check_vma=True)

    def tokens(self, x: jax.Array | None) -> P | None:
        """The spec of a [B, T, ...] array split over positions (None for an absent optional input)."""
        return None if x is None else P(None, self.axes)

    # Inside `shard`:

    def index(self) -> jax.Array:
        return jax.lax.axis_index(self.axes)

    def from_previous(self, x: jax.Array) -> jax.Array:
        """Shard i receives shard i-1's x; shard 0 receives zeros."""
        return jax.lax.ppermute(x, self.axes, [(i, i + 1) for i in range(self.size - 1)])

    def gather(self, x: jax.Array, axis: int, tiled: bool = True) -> jax.Array:
        return jax.lax.all_gather(x, self.axes, axis=axis, tiled=tiled)

    def varying(self, x: jax.Array) -> jax.Array:
        """Marks a value built inside the shard (same on every shard) as per-shard, as a scan carry that
        per-shard data will update must be."""
        return jax.lax.pcast(x, self.axes, to="varying")


def current() -> ContextParallel | None:
    """Context parallelism from the context mesh and rules (as the sharded steps set them); None when off."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return None
    sizes = axis_sizes(mesh)
    axes = tuple(a for a in mesh_axes("length", rules) if sizes[a] > 1)
    return ContextParallel(axes, math.prod(sizes[a] for a in axes)) if axes else None


# ------------------------------------------------------------------------------ short convolution

def causal_conv(cp: ContextParallel, conv: Callable, x: jax.Array, w: jax.Array,
                segment_ids: jax.Array | None) -> jax.Array:
    """conv(x [B, T, C], w [W, C], segment_ids [B, T] | None) -> [B, T, C], a causal convolution reaching W-1
    tokens back, run per shard on the previous shard's last W-1 tokens followed by its own.

    The halo's segment ids come along, so conv's own document masking stops taps at a document start, also one
    exactly at the shard boundary. Shard 0's halo is zeros, which contribute nothing whatever their ids.
    """
    halo = w.shape[0] - 1
    shard_len = cp.shard_length(x.shape[1])
    if halo > shard_len:
        raise ValueError(f"KDAConfig.conv_width={w.shape[0]} reaches {halo} tokens back, more than the "
                         f"{shard_len} tokens per sequence shard ({x.shape[1]} over {cp.describe()})")

    def local(x, w, segment_ids):
        with_halo = lambda a: jnp.concatenate([cp.from_previous(a[:, shard_len - halo:]), a], axis=1)
        seg = None if segment_ids is None else with_halo(segment_ids)
        return conv(with_halo(x), w, seg)[:, halo:]

    tokens = cp.tokens(x)
    return cp.shard(local, (tokens, P(), cp.tokens(segment_ids)), tokens)(x, w, segment_ids)


# -------------------------------------------------------------------------------------------- KDA

def kda(cp: ContextParallel, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
        segment_ids: jax.Array | None, *, chunk_size: int, **options) -> jax.Array:
    """`chunk_kda(...)[0]` from a zero state over sequence shards (layouts as chunk_kda's); -> o [B, T, HV, V].

    options: chunk_kda's g_min, backend, scale.
    """
    shard_len = cp.shard_length(q.shape[1])
    if shard_len < chunk_size:
        raise ValueError(f"KDAConfig.chunk_size={chunk_size} must not exceed the tokens per sequence shard: "
                         f"{q.shape[1]} tokens over {cp.describe()} leave {shard_len}")

    def local(q, k, v, g, beta, segment_ids):
        o, reads, final, transition = scan_with_transition(cp, q, k, v, g, beta, segment_ids,
                                                           chunk_size=chunk_size, **options)
        entering = _entering_state(cp, final, transition, segment_ids)
        correction = jnp.einsum("blhk,bhkv->blhv", reads.astype(jnp.float32), entering, precision=_HIGHEST)
        return (o.astype(jnp.float32) + correction).astype(v.dtype)

    tokens = cp.tokens(q)
    specs = (tokens,) * 5 + (cp.tokens(segment_ids),)
    return cp.shard(local, specs, tokens)(q, k, v, g, beta, segment_ids)


def scan_with_transition(cp: ContextParallel | None, q, k, v, g, beta, segment_ids, **options):
    """One chunked scan from a zero state that also yields the affine map from any incoming state.

    With incoming state E the true outputs are o + einsum(reads, E) and the final state M E + S⁰.
    Returns o [B, T, HV, V] (v's dtype), reads [B, T, HV, K] = P_tᵀ q_t (v's dtype), S⁰ [B, HV, K, V] and
    M [B, HV, K, K] (fp32). The K extra value columns start as I and receive no values, so they carry P_t.
    cp: the shards this runs on inside their shard_map, None outside one.
    """
    batch, _, value_heads, value_dim = v.shape
    key_dim = q.shape[-1]
    values = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (key_dim,), v.dtype)], axis=-1)
    identity = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (batch, value_heads, key_dim, key_dim))
    start = jnp.concatenate([jnp.zeros((batch, value_heads, key_dim, value_dim), jnp.float32), identity], -1)
    start = start if cp is None else cp.varying(start)
    o, final = chunk_kda(q, k, values, g, beta, initial_state=start, output_final_state=True,
                         segment_ids=segment_ids, **options)
    return o[..., :value_dim], o[..., value_dim:], final[..., :value_dim], final[..., value_dim:]


def _entering_state(cp: ContextParallel, final: jax.Array, transition: jax.Array,
                    segment_ids: jax.Array | None) -> jax.Array:
    """The state entering this shard, [B, HV, K, V]: E_0 = 0, E_{i+1} = M_i E_i + S⁰_i, where E_i is dropped
    when shard i's first token starts a document (it then belongs to the previous document only)."""
    maps = cp.gather(jnp.concatenate([final, transition], axis=-1), axis=0, tiled=False)  # [n, B, HV, K, V+K]
    value_dim = final.shape[-1]
    if segment_ids is None:
        continues = jnp.ones(maps.shape[:2], bool)
    else:
        ends = cp.gather(jnp.stack([segment_ids[:, 0], segment_ids[:, -1]]), axis=0, tiled=False)  # [n, 2, B]
        continues = jnp.concatenate([jnp.ones_like(ends[:1, 0], bool), ends[1:, 0] == ends[:-1, 1]])  # [n, B]

    def step(state, xs):
        affine, continues_ = xs
        state = jnp.where(continues_[:, None, None, None], state, 0.0)
        s0, m = affine[..., :value_dim], affine[..., value_dim:]
        return jnp.einsum("bhkj,bhjv->bhkv", m, state, precision=_HIGHEST) + s0, state

    _, entering = jax.lax.scan(step, jnp.zeros_like(final), (maps, continues))
    return entering[cp.index()]


# -------------------------------------------------------------------------------------------- MLA

def latent_attention(cp: ContextParallel, attend: Callable, expand: Callable, q: jax.Array, c_kv: jax.Array,
                     k_shared: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Attention of each shard's queries over the whole row, from the all-gathered latent.

    q: [B, T, H, Dqk]; c_kv: [B, T, R]; k_shared: [B, T, Dr]; segment_ids: [B, T] | None.
    expand(c_kv, k_shared) -> (keys, values) [B, S, H, ·]; attend(q, k, v, segment_ids, kv_segment_ids=,
    q_offset=) -> [B, L, H, Dv] with query i at key position q_offset + i. -> [B, T, H, Dv].
    """
    shard_len = cp.shard_length(q.shape[1])
    rank = c_kv.shape[-1]

    def local(q, c_kv, k_shared, segment_ids):
        latent = cp.gather(jnp.concatenate([c_kv, k_shared.astype(c_kv.dtype)], axis=-1), axis=1)
        k, v = expand(latent[..., :rank], latent[..., rank:].astype(k_shared.dtype))
        kv_segment_ids = None if segment_ids is None else cp.gather(segment_ids, axis=1)
        return attend(q, k, v, segment_ids, kv_segment_ids=kv_segment_ids, q_offset=cp.index() * shard_len)

    tokens = cp.tokens(q)
    specs = (tokens, tokens, tokens, cp.tokens(segment_ids))
    return cp.shard(local, specs, tokens)(q, c_kv, k_shared, segment_ids)
