"""Building blocks shared by the layers: dtypes, projections with logical axis names, norms."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def dtype_of(name: str) -> jnp.dtype:
    return DTYPES[name]


def param_with_axes(module: nn.Module, name: str, init, shape: Sequence[int],
                    axes: Sequence[str | None], dtype=jnp.float32) -> jax.Array:
    """A parameter annotated with logical axis names (mapped to mesh axes by the sharding rules)."""
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


def fan_in_init(fan_in: int):
    """Truncated-normal init with std 1/sqrt(fan_in), the usual choice for pre-norm transformers."""
    return nn.initializers.truncated_normal(stddev=fan_in ** -0.5)


class Dense(nn.Module):
    """Contracts x's last `in_dims` axes with W; `axes` names W's dims (inputs, then outputs).

    features may be a tuple (e.g. (heads, head_dim)): W is then [*in, *features] and the
    output has those trailing dims. in_dims=2 serves output projections [heads, head_dim, d].
    """

    features: int | tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    use_bias: bool = False
    kernel_init: object = None
    in_dims: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        feats = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        in_shape = x.shape[x.ndim - self.in_dims:]
        init = self.kernel_init or fan_in_init(int(np.prod(in_shape)))
        w = param_with_axes(self, "kernel", init, (*in_shape, *feats), self.axes, self.param_dtype)
        contract = tuple(range(x.ndim - self.in_dims, x.ndim))
        y = jnp.tensordot(x.astype(self.dtype), w.astype(self.dtype),
                          axes=(contract, tuple(range(self.in_dims))))
        if self.use_bias:
            b = param_with_axes(self, "bias", nn.initializers.zeros, feats, self.axes[1:],
                                self.param_dtype)
            y = y + b.astype(self.dtype)
        return y


def rms_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / RMS(x) over the last axis, computed in fp32, returned in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learned scale (initialised to 1, never weight-decayed)."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = param_with_axes(self, "scale", nn.initializers.ones, (x.shape[-1],),
                                (self.axis_name,), self.param_dtype)
        return (rms_normalize(x, self.eps) * scale.astype(jnp.float32)).astype(self.dtype)
