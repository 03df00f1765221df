"""Attention residuals: each sublayer reads a learned, input-dependent mix of earlier outputs.

DESIGN §3.4. A mixing site owns a pseudo-query `w ∈ R^d` (zero-initialised, so a new site is a
uniform average of its sources) and a key-norm scale (ones). For sources `v_s` ([B, T, d] each):

    k_s = RMSNorm(v_s) ⊙ scale,   α = softmax_s(w · k_s)  (fp32, no 1/√d),   out = Σ_s α_s v_s

Keys are normalised; values are the raw sources. Modes (`AttnResConfig.mode`):

- `none`: the standard pre-norm residual, x ← x + sublayer(norm(x)); no sites.
- `full`: every sublayer output so far (plus the embedding) is a source: 2L + 1 at the end.
- `block`: sources are the embedding, the finished block sums and the current partial sum. A block
  sum is the sum of its sublayers' outputs (the embedding is its own source, never added in). The
  partial sum restarts every `block_size` layers, so a site reads at most N + 1 tensors per token
  for N = ceil(L / block_size) blocks, not one per sublayer.

Final representation (`AttnResConfig.final`, given to the output norm): the default `"attn_res"`
reads it with one more site (`attn_res_final`, its own pseudo-query) over all sources, including an
unfinished partial block. AttnRes-style models read the last hidden state with the same learned
depth mixing as every sublayer; the plain sum would give every block equal weight again at the one
place the head sees. `"stream"` is the ablation: the plain sum of the embedding and every sublayer
output, which is exactly what mode `none` carries.

A site given a single source returns it unchanged and creates no parameters: a softmax over one
source is 1 whatever the query, so its query would be a parameter without gradient. This happens
at the first sublayer of the model (the embedding is the only source) in `block` and `full`.

Cost: the per-site key scale is folded into the query, keys · w = rms_normalize(v) · (scale ⊙ w),
and the normalisation into a per-token factor after the dot, so a site reads each source twice
(logits, mix) and keeps no copy of it for the backward pass. On a GPU `attn_res_mix` runs the fused
kernels of `pallas_kernels.attn_res` instead: one kernel forward and one backward per site, each
reading every source once, in place of the many small XLA kernels of this version and its autodiff.
"""

from __future__ import annotations

from typing import Callable, Sequence

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridmoe.config import AttnResConfig
from hybridmoe.layers.common import param_with_axes
from pallas_kernels.attn_res import attn_res_mix_fused, is_supported


IMPLS = ("auto", "xla", "pallas", "interpret")


def attn_res_mix(sources: jax.Array | Sequence[jax.Array], query: jax.Array,
                 key_norm_scale: jax.Array, eps: float = 1e-6, *, impl: str = "auto") -> jax.Array:
    """Softmax-over-depth mix of sources, keyed by their RMS-normalised values.

    sources [S, B, T, d] (or a sequence of S arrays [B, T, d]), query [d], key_norm_scale [d]
    -> [B, T, d] in the sources' dtype.
    logits_s = (RMSNorm(sources_s) ⊙ scale) · query (no 1/√d); softmax over S in fp32;
    output = Σ_s softmax_s · sources_s (the raw sources, not the normalised keys).

    impl: "xla" is the code below (the reference); "pallas" the fused kernels of
    `pallas_kernels.attn_res` (one kernel forward, one backward; d a power of two >= 16),
    "interpret" those kernels in Pallas interpret mode (any backend, for tests); "auto" takes
    "pallas" on a GPU when d allows it and S >= 2, else "xla".
    """
    if impl not in IMPLS:
        raise ValueError(f"attn_res_mix.impl must be one of {', '.join(map(repr, IMPLS))}, "
                         f"got {impl!r}")
    if _fused(impl, d=sources[0].shape[-1], num_sources=len(sources)):
        q = key_norm_scale.astype(jnp.float32) * query.astype(jnp.float32)
        return attn_res_mix_fused(list(sources), q, eps, interpret=impl == "interpret")
    dtype = sources[0].dtype
    xs = [x.astype(jnp.float32) for x in sources]  # S × [B, T, d]
    chex.assert_rank(xs, 3)
    chex.assert_equal_shape(xs)
    chex.assert_shape([query, key_norm_scale], (xs[0].shape[-1],))
    q = key_norm_scale.astype(jnp.float32) * query.astype(jnp.float32)  # [d]
    # rms_normalize(x) · q = (x · q) / rms(x): the per-token factor goes on after the dot, so no
    # normalised copy of a source is formed. Sources stay separate arrays, never stacked: a
    # stacked copy per site would be kept for the backward pass (O(sites × sources) memory).
    # The dot is written as a multiply and a sum over d rather than a matrix-vector product: XLA
    # then fuses it with the convert and the sum of squares into one reduction that reads the
    # source once (a dot would go to a BLAS call on an fp32 copy of the source), and it is exact
    # fp32 on GPUs too, where fp32 dots default to TF32.
    logits = jnp.stack([jnp.sum(x * q, axis=-1) * _inv_rms(x, eps) for x in xs])  # [S, B, T]
    weights = jax.nn.softmax(logits, axis=0)  # [S, B, T]
    out = weights[0][..., None] * xs[0]
    for w, x in zip(weights[1:], xs[1:]):
        out = out + w[..., None] * x
    return out.astype(dtype)


def _fused(impl: str, *, d: int, num_sources: int) -> bool:
    """Whether attn_res_mix runs the fused kernels. With S = 1 the XLA code is one multiply by 1."""
    if impl == "auto":
        return jax.default_backend() == "gpu" and is_supported(d) and num_sources >= 2
    return impl in ("pallas", "interpret")


def _inv_rms(x: jax.Array, eps: float) -> jax.Array:
    """x [..., d] fp32 -> 1 / RMS(x) [...], the factor `rms_normalize` applies."""
    return jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)


class AttnResSite(nn.Module):
    """One mixing site: a list of [B, T, d] sources -> [B, T, d].

    Parameters: "query" [d] (zeros, logical axes ("embed",)) and "key_norm" [d] (ones, ("norm",)).
    A single source is returned as is, without creating parameters (see the module docstring).
    """

    eps: float = 1e-6

    @nn.compact
    def __call__(self, sources: Sequence[jax.Array]) -> jax.Array:
        if not sources:
            raise ValueError("AttnResSite.sources must hold at least one array, got none")
        chex.assert_equal_shape(list(sources))
        if len(sources) == 1:
            return sources[0]
        d = sources[0].shape[-1]
        query = param_with_axes(self, "query", nn.initializers.zeros, (d,), ("embed",))
        key_norm = param_with_axes(self, "key_norm", nn.initializers.ones, (d,), ("norm",))
        return attn_res_mix(sources, query, key_norm, self.eps)


Site = Callable[[Sequence[jax.Array]], jax.Array]  # an AttnResSite, or any stand-in in tests


class ResidualStream:
    """Plain-Python bookkeeping of the residual, used inside HybridLM.__call__ (holds arrays).

    Per layer i, the model runs, for the attention and then the FFN sublayer,
    `h = stream.sublayer_input(site); y = sublayer(norm(h)); stream.add(y)`, then
    `stream.end_layer(i)`; at the end `stream.final(final_site)`. Sites are None in mode "none".
    """

    def __init__(self, config: AttnResConfig, embedding: jax.Array):
        self.config = config
        self._embedding = embedding  # [B, T, d]
        self._finished: list[jax.Array] = []  # block: finished block sums; full: every output
        self._partial: jax.Array | None = None  # block: sum of this block's outputs so far
        # The plain running sum x, kept only where it is read (mode none, or final="stream").
        keep_sum = config.mode == "none" or config.final == "stream"
        self._sum: jax.Array | None = embedding if keep_sum else None

    def _sources(self) -> list[jax.Array]:
        partial = [] if self._partial is None else [self._partial]
        return [self._embedding, *self._finished, *partial]

    def _check_site(self, site: Site | None, where: str) -> None:
        if self.config.mode == "none" and site is not None:
            raise ValueError(f"ResidualStream.{where}: AttnResConfig.mode='none' takes no site, "
                             f"got {site!r}")
        if self.config.mode != "none" and site is None:
            raise ValueError(f"ResidualStream.{where}: AttnResConfig.mode={self.config.mode!r} "
                             "needs an AttnResSite, got None")

    def sublayer_input(self, site: Site | None) -> jax.Array:
        """The [B, T, d] input of the next sublayer (before its pre-norm)."""
        self._check_site(site, "sublayer_input")
        if self.config.mode == "none":
            return self._sum
        return site(self._sources())

    def add(self, output: jax.Array) -> None:
        """Accounts one sublayer's output [B, T, d]."""
        chex.assert_equal_shape([output, self._embedding])
        if self._sum is not None:
            self._sum = self._sum + output
        if self.config.mode == "full":
            self._finished.append(output)
        elif self.config.mode == "block":
            self._partial = output if self._partial is None else self._partial + output

    def end_layer(self, layer_index: int) -> None:
        """Block mode: closes the block after every `block_size` layers."""
        if self.config.mode != "block" or (layer_index + 1) % self.config.block_size:
            return
        if self._partial is not None:
            self._finished.append(self._partial)
            self._partial = None

    def final(self, site: Site | None) -> jax.Array:
        """The [B, T, d] representation given to the output norm.

        With final="stream" the site (if any) is not called, so it creates no parameters.
        """
        if self.config.mode != "none" and self.config.final == "stream":
            return self._sum
        self._check_site(site, "final")
        return self._sum if self.config.mode == "none" else site(self._sources())

    @property
    def num_sources(self) -> int:
        """Tensors held as sources now (1 in mode none: the running sum)."""
        if self.config.mode == "none":
            return 1
        return len(self._sources())
