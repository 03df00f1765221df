"""MoE routers (DESIGN §3.3): one pure-function interface, four routers.

    router = make_router(name, num_experts, top_k, **options)
    state = router.init_state(num_tokens=N)   # pytree of arrays: bias, windows, step counter
    out = router.route(scores, state)          # scores: [N, E] probabilities (sigmoid or softmax)
    state = router.update(state, scores, out)  # the state for the NEXT batch

`route` reads only `state`, which holds statistics of earlier batches, never of the batch being routed, and
each token's choice depends on that token's scores alone: routing is causal inside a batch and across steps.

RouterOutput: `expert_ids [N, k_out]` int32; `weights [N, k_out]` the UNBIASED scores at the chosen experts
(0 in inactive slots; renormalisation and routed scaling are the MoE layer's job); `mask [N, k_out]` active
slots (all True for fixed top-k routers, k_out = top_k; expert_threshold has k_out = k_max); `aux_loss` scalar
(0 without one); `stats`, a dict of arrays:
    load [E]        fraction of this batch's active assignments per expert (sums to 1)
    max_vio         max_j load_j / mean_load - 1 for this batch
    min_load        min_j load_j (a fraction, like `load`)
    load_entropy    entropy of `load` / log E (1 = perfectly balanced)
    score_entropy   mean over tokens of the entropy of s_i / sum_j s_ij, / log E
    bias_norm       L2 norm of the routing bias in `state` (0 for softmax_topk_aux)
    max_vio_window  (window routers) MaxVio of the loads pooled over this batch and the previous window-1
    capped_fraction, floored_fraction, experts_per_token   (expert_threshold) tokens with more than k_max
                    passing experts, tokens with none passing, mean active experts per token

Data parallelism: with `axis_name` (a mesh axis name or a tuple of names, for use inside shard_map), the
per-expert counts, means and histograms are summed over those axes, so stats and the updated state are global
and identical on every shard. The `exact` window keeps local margins and is refused with `axis_name`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp

ROUTERS = ("softmax_topk_aux", "bias_sign", "quantile", "expert_threshold")
STATS = ("exact", "histogram")


class RouterOutput(NamedTuple):
    expert_ids: jax.Array  # [N, k_out] int32
    weights: jax.Array  # [N, k_out] float32
    mask: jax.Array  # [N, k_out] bool
    aux_loss: jax.Array  # [] float32
    stats: dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Router:
    """A router: its configuration and three pure functions bound to it."""

    name: str
    num_experts: int
    top_k: int
    k_out: int  # slots per token in RouterOutput (top_k, or k_max for expert_threshold)
    options: tuple[tuple[str, Any], ...]  # every option, defaults filled in
    init_state: Callable[..., dict[str, jax.Array]]
    route: Callable[[jax.Array, dict[str, jax.Array]], RouterOutput]
    update: Callable[[dict[str, jax.Array], jax.Array, RouterOutput], dict[str, jax.Array]]


# ----------------------------------------------------------------------------------------------- options

_DEFAULTS = {
    "softmax_topk_aux": {"alpha": 1e-2, "axis_name": None},
    "bias_sign": {"gamma": 1e-3, "axis_name": None},
    "quantile": {"window": 4, "rate": 1.0, "stats": "exact", "bins": 256, "margin_range": (-1.0, 1.0),
                 "axis_name": None},
    "expert_threshold": {"window": 4, "k_max": None, "stats": "exact", "bins": 256,
                         "score_range": (0.0, 1.0), "axis_name": None},
}


def _fail(field, value, allowed):
    raise ValueError(f"{field} must be {allowed}, got {value!r}")


def _check_int(field, value, lo, hi=None):
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        _fail(field, value, f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}")


def _check_range_pair(field, value):
    ok = (isinstance(value, (tuple, list)) and len(value) == 2
          and all(isinstance(v, (int, float)) and math.isfinite(v) for v in value) and value[0] < value[1])
    if not ok:
        _fail(field, value, "a pair (lo, hi) of finite numbers with lo < hi")


def _check_options(num_experts, top_k, opts):
    if "alpha" in opts and not (isinstance(opts["alpha"], (int, float)) and 0 <= opts["alpha"] < math.inf):
        _fail("alpha", opts["alpha"], "in [0, inf)")
    if "gamma" in opts and not (isinstance(opts["gamma"], (int, float)) and 0 < opts["gamma"] < math.inf):
        _fail("gamma", opts["gamma"], "in (0, inf)")
    if "rate" in opts and not (isinstance(opts["rate"], (int, float)) and 0 < opts["rate"] <= 1):
        _fail("rate", opts["rate"], "in (0, 1]")
    if "window" in opts:
        _check_int("window", opts["window"], 1)
    if "stats" in opts and opts["stats"] not in STATS:
        _fail("stats", opts["stats"], 'in {"exact", "histogram"}')
    if "bins" in opts:
        _check_int("bins", opts["bins"], 2)
    for key in ("margin_range", "score_range"):
        if key in opts:
            _check_range_pair(key, opts[key])
    if "k_max" in opts:
        _check_int("k_max", opts["k_max"], top_k, num_experts)
    axis = opts["axis_name"]
    if not (axis is None or isinstance(axis, str)
            or (isinstance(axis, tuple) and axis and all(isinstance(a, str) for a in axis))):
        _fail("axis_name", axis, "None, a mesh axis name or a non-empty tuple of names")
    if axis is not None and opts.get("stats") == "exact":
        _fail("stats", "exact", '"histogram" when axis_name is set (exact windows hold local margins)')


def make_router(name: str, num_experts: int, top_k: int, **options) -> Router:
    """Builds the router `name`; unknown names and out-of-range options raise ValueError."""
    if name not in _DEFAULTS:
        _fail("router name", name, f"one of {ROUTERS}")
    unknown = sorted(set(options) - set(_DEFAULTS[name]))
    if unknown:
        _fail(f"options of router {name!r}", unknown, f"a subset of {sorted(_DEFAULTS[name])}")
    _check_int("num_experts", num_experts, 2)
    _check_int("top_k", top_k, 1, num_experts - 1 if name == "quantile" else num_experts)  # quantile: k+1 <= E
    opts = {**_DEFAULTS[name], **options}
    if name == "expert_threshold" and opts["k_max"] is None:
        opts["k_max"] = min(2 * top_k, num_experts)
    _check_options(num_experts, top_k, opts)
    for key in ("margin_range", "score_range"):  # hashable, so a Router can be a static jit argument
        if key in opts:
            opts[key] = tuple(float(v) for v in opts[key])
    build = {"softmax_topk_aux": _softmax_topk_aux, "bias_sign": _bias_sign, "quantile": _quantile,
             "expert_threshold": _expert_threshold}[name]
    k_out, init_state, route, update = build(num_experts, top_k, **opts)
    return Router(name, num_experts, top_k, k_out, tuple(sorted(opts.items())), init_state, route, update)


# ------------------------------------------------------------------------------------------ shared parts

def _psum(x, axis_name):
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _check_scores(scores, num_experts):
    chex.assert_rank(scores, 2)
    chex.assert_axis_dimension(scores, 1, num_experts)


def _counts(expert_ids, mask, num_experts, axis_name):
    """Active assignments per expert, summed over data shards: [E] float32."""
    counts = jnp.zeros(num_experts, jnp.float32).at[expert_ids.reshape(-1)].add(
        mask.reshape(-1).astype(jnp.float32))
    return _psum(counts, axis_name)


def _max_vio(counts):
    return counts.shape[-1] * jnp.max(counts) / jnp.maximum(jnp.sum(counts), 1.0) - 1.0


def _load_stats(scores, expert_ids, mask, bias, axis_name):
    """The stats every router reports (see the module docstring)."""
    num_experts = scores.shape[1]
    counts = _counts(expert_ids, mask, num_experts, axis_name)
    load = counts / jnp.maximum(jnp.sum(counts), 1.0)
    log_e = math.log(num_experts)
    p = scores / jnp.maximum(jnp.sum(scores, axis=1, keepdims=True), 1e-30)
    token_entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=1)
    tokens = _psum(jnp.float32(scores.shape[0]), axis_name)
    stats = {
        "load": load,
        "max_vio": _max_vio(counts),
        "min_load": jnp.min(load),
        "load_entropy": -jnp.sum(jnp.where(load > 0, load * jnp.log(jnp.where(load > 0, load, 1.0)), 0.0))
                        / log_e,
        "score_entropy": _psum(jnp.sum(token_entropy), axis_name) / tokens / log_e,
        "bias_norm": jnp.linalg.norm(bias),
    }
    return jax.tree.map(jax.lax.stop_gradient, stats), counts


def _top_k_output(scores, bias, k):
    """Fixed top-k of s + b, weighted by s: (expert_ids, weights, mask)."""
    _, ids = jax.lax.top_k(scores + bias, k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    return ids.astype(jnp.int32), weights, jnp.ones(ids.shape, bool)


def _zero_bias(num_experts):
    return jnp.zeros(num_experts, jnp.float32)


# ------------------------------------------------------------------- windowed quantiles (exact / histogram)
#
# A window holds per-expert samples of the last W steps in a ring: slot = step mod W, slots < min(step, W) hold
# data. `exact` stores, per step and expert, the K = min(N, floor(W·N·k/E) + 1) largest samples as sorted
# order-preserving uint32 keys, [W, E, K] (4·W·E·K bytes: 16 MiB at W=4, E=512, k=16, N=16384): the window's
# Quantile_{1-k/E} never ranks below K from the top, so nothing it needs is dropped. `histogram` stores counts
# [W, E, bins] int32 over a fixed value range (values outside are clipped into the end bins); they add across
# steps and data shards.

def _upper_quantile_rank(n, num_experts, top_k):
    """1-based rank from the top of the Quantile_{1-k/E}: q + 1 with q = floor(n·k/E), without overflow."""
    return (n // num_experts) * top_k + ((n % num_experts) * top_k) // num_experts + 1


def _float_key(x):
    """Order-preserving map float32 -> uint32 (integer sorts are ~3x faster than float sorts on CPU)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _key_float(key):
    b = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def _exact_upper_quantile(keys, valid, num_tokens, top_k):
    """(q+1)-th largest value per expert over the valid slots, q = floor(valid·num_tokens·k/E), exactly.

    keys: [W, E, K] ascending `_float_key`s, each slot's K largest; valid: [W] bool. Bisects the key (32 steps)
    with counts from binary searches into each slot, so no step re-sorts the pooled values. A count that a
    slot's truncation to K cuts short is still >= the rank, so the bisection's test is exact.
    """
    num_experts, kept = keys.shape[1:]
    rank = _upper_quantile_rank(jnp.sum(valid) * num_tokens, num_experts, top_k)
    search = jax.vmap(jax.vmap(functools.partial(jnp.searchsorted, side="left")))

    def count_ge(t):  # [E] -> [E]: kept valid keys >= t
        below = search(keys, jnp.broadcast_to(t, keys.shape[:2]))
        return jnp.sum(jnp.where(valid[:, None], kept - below, 0), axis=0)

    lo = jnp.min(jnp.where(valid[:, None], keys[:, :, 0], jnp.uint32(0xFFFFFFFF)), axis=0)
    hi = jnp.max(jnp.where(valid[:, None], keys[:, :, -1], jnp.uint32(0)), axis=0) + 1

    def bisect(_, lo_hi):  # invariant: count_ge(lo) >= rank > count_ge(hi)
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        ok = count_ge(mid) >= rank
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, bisect, (lo, hi))
    return _key_float(lo)


def _histogram(values, value_range, bins):
    """values: [N, E] -> per-expert counts [E, bins] int32 (out-of-range values land in the end bins)."""
    lo, hi = value_range
    n, num_experts = values.shape
    idx = jnp.clip(jnp.floor((values - lo) * (bins / (hi - lo))), 0, bins - 1).astype(jnp.int32)
    flat = (idx + jnp.arange(num_experts, dtype=jnp.int32) * bins).reshape(-1)
    return jnp.zeros(num_experts * bins, jnp.int32).at[flat].add(1).reshape(num_experts, bins)


def _histogram_upper_quantile(hist, value_range, top_k):
    """(q+1)-th largest value per expert read off counts [E, bins], linear inside the bin.

    The (q+1)-th largest sample lies in the bin where the count from the top first reaches q + 1, and so does
    the returned value: the error is at most one bin width for samples inside `value_range`.
    """
    num_experts, bins = hist.shape
    lo, hi = value_range
    width = (hi - lo) / bins
    rank = _upper_quantile_rank(jnp.sum(hist[0]), num_experts, top_k)
    incl = jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # [E, bins]: samples in bins >= b
    b = jnp.maximum(jnp.sum(incl >= rank, axis=1) - 1, 0)  # [E]
    above = jnp.take_along_axis(incl, b[:, None], 1)[:, 0] - jnp.take_along_axis(hist, b[:, None], 1)[:, 0]
    in_bin = jnp.maximum(jnp.take_along_axis(hist, b[:, None], 1)[:, 0], 1)
    frac = (rank - above).astype(jnp.float32) / in_bin.astype(jnp.float32)
    return lo + (b + 1).astype(jnp.float32) * width - frac * width


class _Window(NamedTuple):
    """Windowed per-expert upper quantile; the buffer lives in the router state under "window"."""

    init: Callable[[int | None], jax.Array]
    push: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (buffer, step, values [N, E]) -> buffer
    quantile: Callable[..., jax.Array]  # (buffer, step after push, tokens per batch) -> [E]


def _make_window(num_experts, top_k, window, stats, bins, value_range, axis_name):
    def slots(step):
        return jnp.arange(window) < step

    if stats == "exact":
        def kept(num_tokens):
            return min(num_tokens, (window * num_tokens * top_k) // num_experts + 1)

        def init(num_tokens):
            if num_tokens is None:
                raise ValueError('num_tokens must be given to init_state when stats="exact" (it sizes the '
                                 "window buffer)")
            _check_int("num_tokens", num_tokens, 1)
            return jnp.zeros((window, num_experts, kept(num_tokens)), jnp.uint32)

        def push(buf, step, values):
            if kept(values.shape[0]) != buf.shape[2]:
                _fail("the batch's token count", values.shape[0], "the num_tokens given to init_state")
            top = jnp.sort(_float_key(values.T), axis=1)[:, values.shape[0] - buf.shape[2]:]
            return jax.lax.dynamic_update_index_in_dim(buf, top, step % window, 0)

        def quantile(buf, step, num_tokens):
            return _exact_upper_quantile(buf, slots(step), num_tokens, top_k)
    else:
        def init(num_tokens):
            del num_tokens  # histograms do not depend on the batch size
            return jnp.zeros((window, num_experts, bins), jnp.int32)

        def push(buf, step, values):
            hist = _psum(_histogram(values, value_range, bins), axis_name)
            return jax.lax.dynamic_update_index_in_dim(buf, hist, step % window, 0)

        def quantile(buf, step, num_tokens):
            del step, num_tokens  # empty slots hold zero counts
            return _histogram_upper_quantile(jnp.sum(buf, axis=0), value_range, top_k)
    return _Window(init, push, quantile)


def _window_router_state(win, num_experts, window, num_tokens=None):
    """State of the window routers: bias, step count, load ring [W, E], quantile window."""
    return {"bias": _zero_bias(num_experts), "step": jnp.int32(0),
            "loads": jnp.zeros((window, num_experts), jnp.float32), "window": win.init(num_tokens)}


def _window_load_stats(state, counts, window):
    """MaxVio of counts pooled over this batch and the previous window-1 batches (`loads` ring)."""
    oldest = state["loads"][state["step"] % window]  # zeros until the ring is full
    return _max_vio(jnp.sum(state["loads"], axis=0) - oldest + counts)


def _push_loads(state, counts, window):
    return jax.lax.dynamic_update_index_in_dim(state["loads"], counts, state["step"] % window, 0)


# --------------------------------------------------------------------------------------------- routers

def _softmax_topk_aux(num_experts, top_k, *, alpha, axis_name):
    """Top-k of the scores plus the Switch/GShard loss alpha·E·sum_j f_j·P_j.

    f_j: fraction of the batch's assignments that go to j (no gradient); P_j: mean score of j (differentiable).
    With uniform routing and softmax scores the loss is alpha, its minimum over balanced assignments.
    """
    def init_state(num_tokens=None):
        del num_tokens
        return {"bias": _zero_bias(num_experts)}

    def route(scores, state):
        _check_scores(scores, num_experts)
        ids, weights, mask = _top_k_output(scores, state["bias"], top_k)
        stats, counts = _load_stats(scores, ids, mask, state["bias"], axis_name)
        tokens = _psum(jnp.float32(scores.shape[0]), axis_name)
        f = counts / (tokens * top_k)
        p = _psum(jnp.sum(scores, axis=0), axis_name) / tokens
        return RouterOutput(ids, weights, mask, alpha * num_experts * jnp.sum(f * p), stats)

    def update(state, scores, out):
        del scores, out
        return state

    return top_k, init_state, route, update


def _bias_sign(num_experts, top_k, *, gamma, axis_name):
    """DeepSeek-V3 auxiliary-loss-free: select by s + b, weight by s; b_j += gamma·sign(mean_load - load_j)."""
    def init_state(num_tokens=None):
        del num_tokens
        return {"bias": _zero_bias(num_experts)}

    def route(scores, state):
        _check_scores(scores, num_experts)
        ids, weights, mask = _top_k_output(scores, state["bias"], top_k)
        stats, _ = _load_stats(scores, ids, mask, state["bias"], axis_name)
        return RouterOutput(ids, weights, mask, jnp.float32(0), stats)

    def update(state, scores, out):
        del scores
        counts = _counts(out.expert_ids, out.mask, num_experts, axis_name)
        # sign(mean - count) == sign(mean_load - load_j): compare counts to avoid a division
        return {"bias": state["bias"] + gamma * jnp.sign(jnp.mean(counts) - counts)}

    return top_k, init_state, route, update


def _quantile(num_experts, top_k, *, window, rate, stats, bins, margin_range, axis_name):
    """Quantile Balancing: route with top-(k+1) of s + b; the bias comes from quantiles of routing margins.

    Update from a batch routed with bias b: alpha_i is token i's (k+1)-th largest biased score, so token i
    takes expert j iff s_ij + b_j > alpha_i. Holding alpha_i fixed, under a new bias b' it takes j iff
    m_ij = s_ij - alpha_i > -b'_j. Setting -b'_j to the (q+1)-th largest m_{.j}, q = N·k/E (the
    Quantile_{1-k/E}), gives every expert exactly q tokens, N·k in all, k per token on average; actual top-k
    re-ranking moves the cutoffs, so re-routing the same batch lands near q (MaxVio 4.8 -> 0.3 in one update
    on the skewed synthetic of the tests) and repeating the update converges to exact balance: when expert j
    gets exactly q tokens, the tokens that rank it (k+1)-th have margin exactly -b_j, which is then the
    (q+1)-th largest, so b_hat = b is a fixed point (with `exact` stats; histograms blur it by a bin).
    The margins use the unbiased s_ij against the biased cutoff so that b_hat is an absolute bias (not a step
    from b): margins of different steps can then be pooled over the window and blended,
        b_hat = -Quantile_{1-k/E}(m over the last `window` steps),  b_hat -= mean(b_hat),
        b <- (1 - rate)·b + rate·b_hat.
    Mean-centring leaves top-k unchanged. Defaults: window=4 (bias error ~1/2 of a single batch's, so MaxVio
    stays near the sampling floor), rate=1 (the exact rule), stats="exact", histograms of 256 bins over
    margin_range=(-1, 1), which covers sigmoid scores with |b| < 1; set it to the score scale for softmax.
    """
    win = _make_window(num_experts, top_k, window, stats, bins, margin_range, axis_name)

    init_state = functools.partial(_window_router_state, win, num_experts, window)

    def route(scores, state):
        _check_scores(scores, num_experts)
        ids, weights, mask = _top_k_output(scores, state["bias"], top_k)
        out_stats, counts = _load_stats(scores, ids, mask, state["bias"], axis_name)
        out_stats["max_vio_window"] = _window_load_stats(state, counts, window)
        return RouterOutput(ids, weights, mask, jnp.float32(0), out_stats)

    def update(state, scores, out):
        _check_scores(scores, num_experts)
        cutoff = jax.lax.top_k(scores + state["bias"], top_k + 1)[0][:, top_k]  # [N]
        buf = win.push(state["window"], state["step"], scores - cutoff[:, None])
        step = state["step"] + 1
        b_hat = -win.quantile(buf, step, scores.shape[0])
        b_hat = b_hat - jnp.mean(b_hat)
        counts = _counts(out.expert_ids, out.mask, num_experts, axis_name)
        return {"bias": (1.0 - rate) * state["bias"] + rate * b_hat, "step": step,
                "loads": _push_loads(state, counts, window), "window": buf}

    return top_k, init_state, route, update


def _expert_threshold(num_experts, top_k, *, window, k_max, stats, bins, score_range, axis_name):
    """Per-expert thresholds tau_j = Quantile_{1-k/E}(s_{.j}) over the window; j fires for i iff s_ij > tau_j.

    At most k_max experts per token (the k_max largest s_ij - tau_j) and at least one (argmax of s - tau when
    none passes). State keeps bias = -tau. The first batch, with no statistics yet, is routed by plain top-k.
    Defaults: window=4, k_max=2·top_k (capped at E), stats="exact", histograms of 256 bins over
    score_range=(0, 1).
    """
    win = _make_window(num_experts, top_k, window, stats, bins, score_range, axis_name)

    init_state = functools.partial(_window_router_state, win, num_experts, window)

    def route(scores, state):
        _check_scores(scores, num_experts)
        margin = scores + state["bias"]  # s - tau
        top, ids = jax.lax.top_k(margin, k_max)  # before the first update bias = 0: top-k of s
        ids, slot, warm = ids.astype(jnp.int32), jnp.arange(k_max), state["step"] > 0
        mask = jnp.where(warm, (top > 0) | (slot == 0), slot < top_k)
        weights = jnp.where(mask, jnp.take_along_axis(scores, ids, axis=1), 0.0)
        out_stats, counts = _load_stats(scores, ids, mask, state["bias"], axis_name)
        passing = jnp.sum(margin > 0, axis=1)
        tokens = _psum(jnp.float32(scores.shape[0]), axis_name)
        frac = lambda x: jnp.where(warm, _psum(jnp.sum(x.astype(jnp.float32)), axis_name) / tokens, 0.0)
        out_stats.update(max_vio_window=_window_load_stats(state, counts, window),
                         capped_fraction=frac(passing > k_max), floored_fraction=frac(passing == 0),
                         experts_per_token=jnp.sum(counts) / tokens)
        return RouterOutput(ids, weights, mask, jnp.float32(0), out_stats)

    def update(state, scores, out):
        _check_scores(scores, num_experts)
        buf = win.push(state["window"], state["step"], scores)
        step = state["step"] + 1
        counts = _counts(out.expert_ids, out.mask, num_experts, axis_name)
        return {"bias": -win.quantile(buf, step, scores.shape[0]), "step": step,
                "loads": _push_loads(state, counts, window), "window": buf}

    return k_max, init_state, route, update
