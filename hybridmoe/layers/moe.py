"""Mixture-of-experts feed-forward (DESIGN §3.3): router, capacity dispatch, routed/shared/latent experts.

Data flow for x [B, T, d]:
    scores = sigmoid|softmax(x W_router) in fp32            [N, E], N = B·T, tokens in position order
    route with the router state of EARLIER batches           -> expert_ids, weights, mask [N, k']
    combine = renormalise(weights over active slots) · routed_scaling
    y = dispatch(x, expert_ids, combine, mask, experts) + shared(x)

The router state (biases, statistics windows) lives in the "router" variable collection, never in params:
`apply(..., mutable=["router"])` returns the state for the next batch.

Under a mesh (`jax.sharding.use_abstract_mesh` + `nn.logical_axis_rules`, as the sharded train step sets
them), route -> dispatch -> experts -> combine run inside one shard_map: each shard routes its own tokens,
router statistics are summed over the token shards, and the expert buffers travel by all_to_all over the
`expert` axis (hybridmoe.sharding.ExpertParallel). Dropless dispatch under expert parallelism is the
capacity path with full capacity (C = the shard's token count): `jax.lax.ragged_all_to_all` is not
implemented by XLA:CPU in jax 0.11.2, so a ragged exchange could not be tested here.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridmoe.config import MoEConfig, RouterConfig
from hybridmoe import sharding
from hybridmoe.layers.common import Dense, RMSNorm, fan_in_init, param_with_axes
from hybridmoe.routing import Router, make_router
from pallas_kernels import moe as grouped_gemm

SITU_BETA_GATE, SITU_BETA_UP = 4.0, 25.0


def glu(g: jax.Array, u: jax.Array, activation: str) -> jax.Array:
    """The gated activation, in fp32, returned in g's dtype.

    swiglu: silu(g)·u;  situ: β₁tanh(g/β₁)σ(g) · β₂tanh(u/β₂) with β₁=4, β₂=25 (bounded both ways).
    """
    g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
    if activation == "swiglu":
        h = jax.nn.silu(g32) * u32
    elif activation == "situ":
        h = (SITU_BETA_GATE * jnp.tanh(g32 / SITU_BETA_GATE) * jax.nn.sigmoid(g32)
             * SITU_BETA_UP * jnp.tanh(u32 / SITU_BETA_UP))
    else:
        raise ValueError(f"MoEConfig.activation must be one of 'swiglu', 'situ', got {activation!r}")
    return h.astype(g.dtype)


class DenseFFN(nn.Module):
    """Gated feed-forward (x W_gate, x W_up) -> glu -> W_down: x [..., d] -> [..., d_model].

    Used for the first_k_dense layers and for the shared experts.
    """

    width: int
    d_model: int
    activation: str = "swiglu"
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        g = Dense(self.width, ("embed", "mlp"), name="w_gate", **kw)(x)
        u = Dense(self.width, ("embed", "mlp"), name="w_up", **kw)(x)
        return Dense(self.d_model, ("mlp", "embed"), name="w_down", **kw)(glu(g, u, self.activation))


class ExpertWeights(NamedTuple):
    w_gate: jax.Array  # [E, d, F]
    w_up: jax.Array  # [E, d, F]
    w_down: jax.Array  # [E, F, d]


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(capacity_factor · N · k / E), clipped to [1, N] (an expert sees a token once)."""
    return min(max(math.ceil(capacity_factor * num_tokens * top_k / num_experts), 1), num_tokens)


def _apply_experts(x_buf: jax.Array, w: ExpertWeights, activation: str,
                   parallel: sharding.ExpertParallel | None = None) -> jax.Array:
    """x_buf: [E, C, d] -> [E, C, d], every expert on its own buffer (batched einsums).

    With `parallel` (inside shard_map), w holds this shard's E/P experts and F/tp columns: the buffers go
    to their experts' shards and back by all_to_all, and the partial down-projections are summed.
    """
    dt, num_experts = x_buf.dtype, x_buf.shape[0]
    if parallel is not None:
        x_buf = parallel.to_experts(x_buf, w.w_gate.shape[0])
    g = jnp.einsum("ecd,edf->ecf", x_buf, w.w_gate.astype(dt))
    u = jnp.einsum("ecd,edf->ecf", x_buf, w.w_up.astype(dt))
    y = jnp.einsum("ecf,efd->ecd", glu(g, u, activation), w.w_down.astype(dt))
    return y if parallel is None else parallel.from_experts(y, num_experts)


def dispatch_capacity(x: jax.Array, expert_ids: jax.Array, combine: jax.Array, mask: jax.Array,
                      experts: ExpertWeights, *, activation: str, capacity: int | None,
                      parallel: sharding.ExpertParallel | None = None) -> tuple[jax.Array, jax.Array]:
    """Sort by expert -> buffers [E, C, d] -> batched experts -> unsort and combine.

    x: [N, d] tokens in position order; expert_ids, combine, mask: [N, k]; capacity: C slots per expert.
    Returns y [N, d] and the number of active assignments that found no slot (dropped, int32 []).

    The sort is stable and keyed by expert, then by assignment index token·k + slot, so inside each expert
    the earliest tokens take the slots and an overflow drops the LATEST ones: whether a token is dropped
    depends only on tokens at or before its own position (causal).
    """
    n, k = expert_ids.shape
    num_experts, d = experts.w_gate.shape[0], x.shape[-1]
    if parallel is not None:  # w holds this shard's experts; buffers cover all of them
        num_experts *= parallel.size(parallel.expert_axes)
    c = capacity
    flat = jnp.where(mask, expert_ids, num_experts).reshape(-1)  # inactive slots -> sentinel E, sorted last
    order = jnp.argsort(flat, stable=True)  # [N·k]
    sorted_expert = flat[order]
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[flat].add(1)
    rank = jnp.arange(n * k, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[sorted_expert]
    keep = (sorted_expert < num_experts) & (rank < c)
    # Buffer row of each assignment (num_experts·C = no row), back in assignment order.
    row = jnp.zeros(n * k, jnp.int32).at[order].set(
        jnp.where(keep, sorted_expert * c + rank, num_experts * c))
    token_of_row = jnp.full(num_experts * c, n, jnp.int32).at[row].set(
        jnp.arange(n * k, dtype=jnp.int32) // k, mode="drop")  # n = empty slot
    x_buf = jnp.take(x, token_of_row, axis=0, mode="fill", fill_value=0).reshape(num_experts, c, d)
    y_buf = _apply_experts(x_buf, experts, activation, parallel).reshape(num_experts * c, d)
    y_assign = jnp.take(y_buf, row, axis=0, mode="fill", fill_value=0).reshape(n, k, d)
    y = jnp.einsum("nkd,nk->nd", y_assign.astype(jnp.float32), combine.astype(jnp.float32))
    dropped = jnp.sum(mask, dtype=jnp.int32) - jnp.sum(keep, dtype=jnp.int32)
    return y.astype(x.dtype), dropped


def dispatch_dropless(x: jax.Array, expert_ids: jax.Array, combine: jax.Array, mask: jax.Array,
                      experts: ExpertWeights, *, activation: str, capacity: int | None,
                      parallel: sharding.ExpertParallel | None = None) -> tuple[jax.Array, jax.Array]:
    """Nothing dropped. CPU stand-in: the capacity path with C = N; the GPU grouped-GEMM path replaces it."""
    if capacity is not None:
        raise ValueError(f"dispatch_dropless takes capacity=None, got {capacity!r}")
    return dispatch_capacity(x, expert_ids, combine, mask, experts, activation=activation,
                             capacity=x.shape[0], parallel=parallel)


def dispatch_grouped(x: jax.Array, expert_ids: jax.Array, combine: jax.Array, mask: jax.Array,
                     experts: ExpertWeights, *, activation: str, capacity: int | None,
                     parallel: sharding.ExpertParallel | None = None,
                     grouped_config: grouped_gemm.GroupedMatmulConfig | None = None
                     ) -> tuple[jax.Array, jax.Array]:
    """Dropless: sort assignments by expert -> three grouped GEMMs over the ragged groups -> unsort, combine.

    The grouped GEMM is pallas_kernels.moe.grouped_matmul (Mosaic GPU kernels on Hopper, lax.ragged_dot
    elsewhere). Inactive slots are sorted after every expert's rows, where the grouped GEMM yields zeros.
    Under expert parallelism this is dispatch_dropless (a ragged all_to_all is untested here).
    """
    if capacity is not None:
        raise ValueError(f"dispatch_grouped takes capacity=None, got {capacity!r}")
    if parallel is not None:
        return dispatch_dropless(x, expert_ids, combine, mask, experts, activation=activation,
                                 capacity=None, parallel=parallel)
    n, k = expert_ids.shape
    num_experts, dt = experts.w_gate.shape[0], x.dtype
    flat = jnp.where(mask, expert_ids, num_experts).reshape(-1)  # inactive slots -> sentinel E, sorted last
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # sorted row -> assignment token·k + slot
    inverse = jnp.zeros(n * k, jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
    group_sizes = jnp.zeros(num_experts + 1, jnp.int32).at[flat].add(1)[:num_experts]
    mm = functools.partial(grouped_gemm.grouped_matmul, group_sizes=group_sizes, config=grouped_config)
    x_sorted = grouped_gemm.expand_sorted(x, order // k, inverse)
    h = glu(mm(x_sorted, experts.w_gate.astype(dt)), mm(x_sorted, experts.w_up.astype(dt)), activation)
    y_assign = grouped_gemm.permute_rows(mm(h, experts.w_down.astype(dt)), inverse, order).reshape(n, k, -1)
    w = jnp.where(mask, combine, 0).astype(jnp.float32)
    y = jnp.einsum("nkd,nk->nd", y_assign.astype(jnp.float32), w)
    return y.astype(dt), jnp.zeros((), jnp.int32)


def dispatch_dropless_auto(x: jax.Array, expert_ids: jax.Array, combine: jax.Array, mask: jax.Array,
                           experts: ExpertWeights, *, activation: str, capacity: int | None,
                           parallel: sharding.ExpertParallel | None = None) -> tuple[jax.Array, jax.Array]:
    """DISPATCH["dropless"]: dispatch_grouped where the Mosaic GPU grouped GEMM runs (Hopper, bf16/f16,
    tile-aligned widths, no expert parallelism), else dispatch_dropless."""
    d_in, width = experts.w_gate.shape[1:]
    if parallel is None and grouped_gemm.mosaic_supported(x.dtype, d_in, width) \
            and grouped_gemm.mosaic_supported(x.dtype, width, d_in):
        return dispatch_grouped(x, expert_ids, combine, mask, experts, activation=activation,
                                capacity=capacity)
    return dispatch_dropless(x, expert_ids, combine, mask, experts, activation=activation,
                             capacity=capacity, parallel=parallel)


DISPATCH: dict[str, Callable[..., tuple[jax.Array, jax.Array]]] = {
    "capacity": dispatch_capacity, "dropless": dispatch_dropless_auto}


def _chunked(dispatch: Callable[..., tuple[jax.Array, jax.Array]], x: jax.Array, expert_ids: jax.Array,
             combine: jax.Array, mask: jax.Array, experts: ExpertWeights, *, chunk: int
             ) -> tuple[jax.Array, jax.Array]:
    """A dropless dispatch over consecutive chunks of `chunk` tokens (x [N, d] -> y [N, d], dropped).

    Each chunk runs under jax.checkpoint inside a lax.map, so forward and backward hold one chunk's
    dispatch buffers at a time. The last chunk is padded with inactive slots (mask False), which
    dropless dispatch gives no output. Valid for dropless only: every token's result depends on its
    own routing alone.
    """
    n = x.shape[0]
    chunks = -(-n // chunk)
    pad = lambda a, value: jnp.pad(a, [(0, chunks * chunk - n)] + [(0, 0)] * (a.ndim - 1),  # noqa: E731
                                   constant_values=value)
    split = lambda a: a.reshape(chunks, chunk, *a.shape[1:])  # noqa: E731
    xs = tuple(split(pad(a, v)) for a, v in ((x, 0), (expert_ids, 0), (combine, 0), (mask, False)))

    @jax.checkpoint
    def one(args):
        return dispatch(*args, experts)

    y, dropped = jax.lax.map(one, xs)
    return y.reshape(chunks * chunk, -1)[:n], jnp.sum(dropped)


def combine_weights(weights: jax.Array, mask: jax.Array, routed_scaling: float) -> jax.Array:
    """weights, mask: [N, k] -> [N, k]: renormalised over the active slots, times routed_scaling.

    Renormalised for softmax scores too (DeepSeek's norm_topk_prob), so both score functions give
    convex combinations of the chosen experts before scaling.
    """
    w = jnp.where(mask, weights, 0.0)
    return w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * routed_scaling


class MoE(nn.Module):
    """x [B, T, d] -> (y [B, T, d], aux). aux = {"router_stats": dict, "aux_loss": [] fp32}."""

    config: MoEConfig
    router: RouterConfig
    d_model: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    norm_eps: float = 1e-6

    def _expert_weights(self, width_in: int) -> ExpertWeights:
        cfg = self.config
        e, f = cfg.num_experts, cfg.expert_width
        axis_in = "latent" if cfg.latent_dim else "embed"
        make = lambda name, shape, axes, fan_in: param_with_axes(
            self, name, fan_in_init(fan_in), shape, axes, self.param_dtype)
        return ExpertWeights(
            make("w_gate", (e, width_in, f), ("expert", axis_in, "mlp"), width_in),
            make("w_up", (e, width_in, f), ("expert", axis_in, "mlp"), width_in),
            make("w_down", (e, f, width_in), ("expert", "mlp", axis_in), f))

    def _router(self, parallel: sharding.ExpertParallel | None) -> Router:
        cfg, opts = self.config, self.router.options()
        axes = None if parallel is None else parallel.router_axes
        if axes is not None and self.router.name in ("quantile", "expert_threshold") \
                and opts.get("stats", "exact") == "exact":
            raise ValueError(f"RouterConfig.stats='exact' keeps each shard's own statistics window: with "
                             f"tokens split over mesh axes {axes}, router {self.router.name!r} needs "
                             f"RouterConfig.stats='histogram' (histograms are summed over the shards)")
        return make_router(self.router.name, cfg.num_experts, cfg.top_k, **opts, axis_name=axes)

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        cfg = self.config
        chex.assert_rank(x, 3)
        chex.assert_axis_dimension(x, 2, self.d_model)
        b, t, d = x.shape
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = x.astype(self.dtype)
        parallel = None if self.is_initializing() else sharding.expert_parallel(
            cfg.num_experts, cfg.expert_width)
        router = self._router(parallel)
        state = self.variable("router", "state", router.init_state, num_tokens=b * t)
        w_router = param_with_axes(self, "w_router", fan_in_init(d), (d, cfg.num_experts),
                                   ("embed", "expert"), jnp.float32)
        h = x
        if cfg.latent_dim:
            h = Dense(cfg.latent_dim, ("embed", "latent"), name="latent_down", **kw)(h)
        experts = self._expert_weights(h.shape[-1])
        # Init leaves the fresh state; a mutable apply writes the state for the NEXT batch only.
        update = self.is_mutable_collection("router") and not self.is_initializing()
        fn = functools.partial(routed_experts, config=cfg, router=router, update=update,
                               parallel=parallel)
        if parallel is not None:
            fn = parallel.shard(fn)
        y, new_state, stats, aux_loss = fn(x, h, w_router, tuple(experts), state.value)
        if update:
            state.value = new_state
        if cfg.latent_dim:
            y = RMSNorm(self.norm_eps, name="latent_norm", **kw)(y)
            y = Dense(d, ("latent", "embed"), name="latent_up", **kw)(y)
        if cfg.num_shared_experts:
            y = y + DenseFFN(cfg.num_shared_experts * cfg.expert_width, d, cfg.activation,
                             name="shared", **kw)(x)
        return y, {"router_stats": stats, "aux_loss": aux_loss}


def routed_experts(x: jax.Array, h: jax.Array, w_router: jax.Array, experts: tuple, state: Any, *,
                   config: MoEConfig, router: Router, update: bool,
                   parallel: sharding.ExpertParallel | None = None):
    """Route, dispatch, run the routed experts and combine, on one shard's tokens (all, without `parallel`).

    x: [B, T, d] router input; h: [B, T, d_in] expert input (x or its latent projection); experts: the
    (w_gate, w_up, w_down) arrays. -> (y [B, T, d_in], router state for the next batch, stats, aux_loss).
    Tokens are flattened time-major, so token order = position order and capacity dropping stays causal
    across the whole batch (a token's slot never depends on any row's later positions).
    """
    cfg = config
    b, t, _ = x.shape
    flat = lambda a: a.swapaxes(0, 1).reshape(t * b, a.shape[-1])
    logits = jnp.dot(flat(x).astype(jnp.float32), w_router)
    scores = jax.nn.sigmoid(logits) if cfg.score_fn == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    out = router.route(scores, state)
    if update:
        state = router.update(state, jax.lax.stop_gradient(scores),
                              jax.tree.map(jax.lax.stop_gradient, out))
    combine = combine_weights(out.weights, out.mask, cfg.routed_scaling)
    capacity = (expert_capacity(t * b, cfg.top_k, cfg.num_experts, cfg.capacity_factor)
                if cfg.dispatch == "capacity" else None)
    dispatch = functools.partial(DISPATCH[cfg.dispatch], activation=cfg.activation, capacity=capacity,
                                 parallel=parallel)
    if cfg.dispatch_chunk and t * b > cfg.dispatch_chunk:
        dispatch = functools.partial(_chunked, dispatch, chunk=cfg.dispatch_chunk)
    y, dropped = dispatch(flat(h), out.expert_ids, combine, out.mask, ExpertWeights(*experts))
    total = (lambda v: v) if parallel is None else parallel.psum_tokens
    active = jnp.maximum(total(jnp.sum(out.mask, dtype=jnp.int32)), 1).astype(jnp.float32)
    stats = {**out.stats, "dropped_fraction": jax.lax.stop_gradient(total(dropped) / active)}
    return y.reshape(t, b, -1).swapaxes(0, 1), state, stats, out.aux_loss
