"""Kimi Delta Attention layer (DESIGN §3.1): projections, short convolutions, gates, the chunked op.

q, k, v = SiLU(causal depthwise conv(W x)); forget-gate input f = W_f↑ W_f↓ x (rank = head dim);
β = sigmoid(W_β x); g = bounded or softplus gate of f; o = chunk_kda(...);
output = W_o · concat_h[RMSNorm_h(o_h) · w ⊙ sigmoid(W_g x)].

Under a mesh whose "length" rule splits positions (hybridmoe.context_parallel), the convolutions take a halo
from the previous sequence shard and the chunked scan passes its state across shards; all else is per token.
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

    def _dense(self, features, axes, name):
        return Dense(features, axes, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        b, t, _ = x.shape
        h, hv, dk, dv = cfg.num_heads, cfg.value_heads, cfg.head_dim, cfg.value_dim
        # init only creates parameters, the same on either path
        parallel = None if self.is_initializing() else context_parallel.current()

        def conv_proj(name, heads, dim):
            y = self._dense((heads * dim,), ("embed", "heads_x_dim"), f"w_{name}")(x)
            y = ShortConv(cfg.conv_width, "heads_x_dim", self.dtype, self.param_dtype, parallel,
                          name=f"conv_{name}")(y, segment_ids)
            return y.reshape(b, t, heads, dim)

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
            o, _ = chunk_kda(q, k, v, g, beta, segment_ids=segment_ids, **options)
        else:
            o = context_parallel.kda(parallel, q, k, v, g, beta, segment_ids, **options)

        norm_w = param_with_axes(self, "o_norm", nn.initializers.ones, (dv,), ("norm",),
                                 self.param_dtype)
        o = rms_normalize(o, self.norm_eps) * norm_w.astype(jnp.float32)
        gate = self._dense((hv, dv), ("embed", "heads", "head_dim"), "w_gate")(x)
        o = (o * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(self.dtype)
        return Dense(self.d_model, ("heads", "head_dim", "embed"), dtype=self.dtype,
                     param_dtype=self.param_dtype, in_dims=2, name="w_o")(o)


def rms_l2(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """L2-normalise the last axis in fp32 (q and k per head)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
