"""Kimi Delta Attention layer (DESIGN §3.1): projections, short convolutions, gates, the chunked op.

q, k, v = SiLU(causal depthwise conv(W x)); forget-gate input f = W_f↑ W_f↓ x (rank = head dim);
β = sigmoid(W_β x); g = bounded or softplus gate of f; o = chunk_kda(...);
output = W_o · concat_h[RMSNorm_h(o_h) · w ⊙ sigmoid(W_g x)].

Under a mesh whose "length" rule splits positions (hybridmoe.context_parallel), the convolutions take a halo
from the previous sequence shard and the chunked scan passes its state across shards; all else is per token.
KDAConfig.seq_chunk runs the layer on one device the same way, over rematerialised pieces of the row in turn.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridmoe import context_parallel
from hybridmoe.config import KDAConfig
from hybridmoe.layers.common import Dense, param_with_axes, rms_normalize
from pallas_kernels.kda import bounded_gate, chunk_kda, softplus_gate


def causal_depthwise_conv(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """x: [B, T, C], w: [W, C] -> [B, T, C]; y[t] = Σ_s w[W-1-s] · x[t-s].

    Taps that reach before the start of the token's document are zeroed, so packed documents
    never see each other through the convolution.
    """
    width, t = w.shape[0], x.shape[1]
    y = jnp.zeros_like(x)
    for s in range(width):
        shifted = jnp.pad(x, ((0, 0), (s, 0), (0, 0)))[:, :t]
        if segment_ids is not None and s > 0:
            seg_shifted = jnp.pad(segment_ids, ((0, 0), (s, 0)), constant_values=-1)[:, :t]
            shifted = jnp.where((seg_shifted == segment_ids)[..., None], shifted, 0)
        y = y + shifted * w[width - 1 - s].astype(x.dtype)
    return y


def _dt_bias_init(key, shape, dtype=jnp.float32):
    """softplus⁻¹(dt) with dt log-uniform in [1e-3, 1e-1]."""
    dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1)))
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class ShortConv(nn.Module):
    """Causal depthwise convolution followed by SiLU. x: [B, T, C] -> [B, T, C]."""

    width: int
    axis: str
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    parallel: context_parallel.ContextParallel | None = None  # sequence shards: the halo crosses them

    @nn.compact
    def __call__(self, x, segment_ids=None):
        w = param_with_axes(self, "kernel", nn.initializers.normal(self.width ** -0.5),
                            (self.width, x.shape[-1]), ("conv", self.axis), self.param_dtype)
        w = w.astype(self.dtype)
        if self.parallel is None:
            y = causal_depthwise_conv(x, w, segment_ids)
        else:
            y = context_parallel.causal_conv(self.parallel, causal_depthwise_conv, x, w, segment_ids)
        return jax.nn.silu(y)


class KDA(nn.Module):
    """x: [B, T, d] -> [B, T, d]."""

    config: KDAConfig
    d_model: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    norm_eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        # init only creates parameters, the same on either path
        parallel = None if self.is_initializing() else context_parallel.current()
        mixer = KDAPiece(cfg, self.d_model, self.dtype, self.param_dtype, self.norm_eps, parallel)
        nn.share_scope(self, mixer)  # the piece's parameters are the layer's own (w_q, conv_q, ...)
        piece = cfg.seq_chunk
        if piece is None or x.shape[1] <= piece or parallel is not None or self.is_initializing():
            return mixer(x, segment_ids)[0]
        return _over_pieces(mixer, x, segment_ids, piece, cfg.conv_width - 1)


class KDAPiece(nn.Module):
    """The KDA layer on one stretch of the sequence, given what it needs from before the stretch.

    (x [B, L, d], segment_ids [B, L] or None, halo [B, W-1, d] or None: the W-1 inputs before x, zeros at the
    row's start, halo_ids [B, W-1] (-1 at the row's start), state [B, HV, K, V] fp32 entering x's first
    document, or None) -> (y [B, L, d], the state after x, fp32).
    """

    config: KDAConfig
    d_model: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    norm_eps: float = 1e-6
    parallel: context_parallel.ContextParallel | None = None

    def _dense(self, features, axes, name):
        return Dense(features, axes, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

    @nn.compact
    def __call__(self, x, segment_ids=None, halo=None, halo_ids=None, state=None):
        cfg, parallel = self.config, self.parallel
        b, t, _ = x.shape
        h, hv, dk, dv = cfg.num_heads, cfg.value_heads, cfg.head_dim, cfg.value_dim

        def conv_proj(name, heads, dim):
            dense = self._dense((heads * dim,), ("embed", "heads_x_dim"), f"w_{name}")
            y, ids = dense(x), segment_ids
            if halo is not None:  # the convolution's taps reach W-1 tokens back, into the previous stretch
                y = jnp.concatenate([dense(halo), y], axis=1)
                ids = None if ids is None else jnp.concatenate([halo_ids, ids], axis=1)
            y = ShortConv(cfg.conv_width, "heads_x_dim", self.dtype, self.param_dtype, parallel,
                          name=f"conv_{name}")(y, ids)
            return y[:, y.shape[1] - t:].reshape(b, t, heads, dim)

        q = rms_l2(conv_proj("q", h, dk))
        k = rms_l2(conv_proj("k", h, dk))
        v = conv_proj("v", hv, dv)

        f = self._dense((dk,), ("embed", "head_dim"), "w_f_down")(x)
        f = self._dense((hv, dk), ("head_dim", "heads", "head_dim"), "w_f_up")(f)
        a_log = param_with_axes(self, "a_log", nn.initializers.zeros, (hv,), ("heads",),
                                jnp.float32)
        dt_bias = param_with_axes(self, "dt_bias", _dt_bias_init, (hv, dk), ("heads", "head_dim"),
                                  jnp.float32)
        f = f.astype(jnp.float32)
        if cfg.gate == "bounded":
            g = bounded_gate(f, a_log, dt_bias, cfg.g_min)
        else:
            g = softplus_gate(f, a_log, dt_bias)
        beta = jax.nn.sigmoid(
            self._dense((hv,), ("embed", "heads"), "w_beta")(x).astype(jnp.float32))

        q, k = q.astype(self.dtype), k.astype(self.dtype)
        options = dict(g_min=cfg.bound, chunk_size=cfg.chunk_size, backend=cfg.backend)
        if parallel is None:
            o, state = chunk_kda(q, k, v, g, beta, segment_ids=segment_ids, initial_state=state,
                                 output_final_state=True, **options)
        else:
            o = context_parallel.kda(parallel, q, k, v, g, beta, segment_ids, **options)

        norm_w = param_with_axes(self, "o_norm", nn.initializers.ones, (dv,), ("norm",),
                                 self.param_dtype)
        o = rms_normalize(o, self.norm_eps) * norm_w.astype(jnp.float32)
        gate = self._dense((hv, dv), ("embed", "heads", "head_dim"), "w_gate")(x)
        o = (o * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(self.dtype)
        y = Dense(self.d_model, ("heads", "head_dim", "embed"), dtype=self.dtype,
                  param_dtype=self.param_dtype, in_dims=2, name="w_o")(o)
        return y, state


def _over_pieces(mixer: KDAPiece, x: jax.Array, segment_ids: jax.Array | None, piece: int,
                 halo_len: int) -> jax.Array:
    """The layer as a scan over pieces of `piece` tokens, each under remat (KDAConfig.seq_chunk).

    The carry is the fp32 state; each piece also gets the halo_len inputs before it (and their ids) for the
    convolutions. A piece whose first token starts a new document drops the incoming state, as the kernel does
    at a document start inside a piece. T is padded to whole pieces with zero inputs after the last token,
    which causality keeps out of every real output.
    """
    b, t, d = x.shape
    n = -(-t // piece)
    pad = n * piece - t
    split = lambda a: jnp.swapaxes(a.reshape(b, n, piece, *a.shape[2:]), 0, 1)  # noqa: E731 [n, B, L, ...]
    xs = split(jnp.pad(x, ((0, 0), (0, pad), (0, 0))))

    def before(a, fill):  # [n, B, L, ...] -> [n, B, halo_len, ...]: the tail of the previous piece
        first = jnp.full_like(a[:1, :, :halo_len], fill)
        return jnp.concatenate([first, a[:-1, :, piece - halo_len:]], axis=0)

    ids = prev_id = None
    if segment_ids is not None:
        ids = split(jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge"))
        prev_id = jnp.concatenate([ids[:1, :, 0], ids[:-1, :, -1]], axis=0)  # [n, B]; piece 0 continues
    halo = halo_ids = None
    if halo_len:
        halo = before(xs, 0)
        halo_ids = None if ids is None else before(ids, -1)

    def body(module, state, inputs):
        x_i, ids_i, halo_i, halo_ids_i, prev_i = inputs
        if ids_i is not None:
            state = jnp.where((prev_i == ids_i[:, 0])[:, None, None, None], state, 0.0)
        y, state = module(x_i, ids_i, halo_i, halo_ids_i, state)
        return state, y

    cfg = mixer.config
    state = jnp.zeros((b, cfg.value_heads, cfg.head_dim, cfg.value_dim), jnp.float32)
    scan = nn.scan(nn.remat(body, prevent_cse=False), variable_broadcast="params",
                   split_rngs={"params": False}, in_axes=0, out_axes=0)
    _, ys = scan(mixer, state, (xs, ids, halo, halo_ids, prev_id))  # ys [n, B, L, d]
    return jnp.swapaxes(ys, 0, 1).reshape(b, n * piece, d)[:, :t]


def rms_l2(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """L2-normalise the last axis in fp32 (q and k per head)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
