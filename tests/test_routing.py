"""Tests for hybridmoe.routing: stats, losses, quantile estimators against numpy, balance, causality, errors."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe import routing
from hybridmoe.routing import make_router
from hybridmoe.routing_synthetic import simulate, skewed_scores

ALL_ROUTERS = [("softmax_topk_aux", {}), ("bias_sign", {}), ("quantile", {}),
               ("quantile", {"stats": "histogram", "window": 2}), ("expert_threshold", {}),
               ("expert_threshold", {"stats": "histogram", "window": 2})]



# ------------------------------------------------------------------------------------- stats, loss, masks

def test_load_stats_on_hand_made_scores():
    scores = jnp.array([[0.9, 0.1, 0.8, 0.2],
                        [0.7, 0.6, 0.1, 0.3],
                        [0.2, 0.9, 0.4, 0.1]], jnp.float32)
    r = make_router("bias_sign", 4, 2)
    out = jax.jit(r.route)(scores, r.init_state())
    np.testing.assert_array_equal(out.expert_ids, [[0, 2], [0, 1], [1, 2]])
    np.testing.assert_allclose(out.weights, [[0.9, 0.8], [0.7, 0.6], [0.9, 0.4]])
    assert out.mask.dtype == jnp.bool_ and bool(jnp.all(out.mask))
    load = np.array([2, 2, 2, 0]) / 6
    np.testing.assert_allclose(out.stats["load"], load)
    np.testing.assert_allclose(out.stats["max_vio"], 4 * 2 / 6 - 1, rtol=1e-6)
    assert float(out.stats["min_load"]) == 0.0
    np.testing.assert_allclose(out.stats["load_entropy"], math.log(3) / math.log(4), rtol=1e-6)
    p = np.asarray(scores) / np.asarray(scores).sum(1, keepdims=True)
    np.testing.assert_allclose(out.stats["score_entropy"], (-(p * np.log(p)).sum(1)).mean() / math.log(4),
                               rtol=1e-6)
    assert float(out.stats["bias_norm"]) == 0.0 and float(out.aux_loss) == 0.0


def test_window_stats():
    """max_vio_window pools this batch with the previous window-1; bias_norm is the norm of the state's bias."""
    e, k, n = 8, 2, 32
    r = make_router("quantile", e, k, window=2, stats="histogram")

    @jax.jit
    def step(state, s):
        out = r.route(s, state)
        return r.update(state, s, out), out

    state, counts = r.init_state(), []
    for i in range(3):
        bias = state["bias"]
        state, out = step(state, skewed_scores(jax.random.PRNGKey(i), n, e))
        counts.append(np.bincount(np.asarray(out.expert_ids).ravel(), minlength=e))
        pooled = counts[-1] + (counts[-2] if i else 0)
        np.testing.assert_allclose(out.stats["max_vio_window"], e * pooled.max() / pooled.sum() - 1, rtol=1e-6)
        np.testing.assert_allclose(out.stats["bias_norm"], np.linalg.norm(bias), rtol=1e-6)
    assert float(out.stats["bias_norm"]) > 0


def test_aux_loss_formula():
    scores = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (16, 8)), axis=1)
    r = make_router("softmax_topk_aux", 8, 2, alpha=0.1)
    out = jax.jit(r.route)(scores, r.init_state())
    f = np.bincount(np.asarray(out.expert_ids).ravel(), minlength=8) / (16 * 2)
    expected = 0.1 * 8 * np.sum(f * np.asarray(scores).mean(0))
    np.testing.assert_allclose(out.aux_loss, expected, rtol=1e-6)
    grad = jax.jit(jax.grad(lambda s: r.route(s, r.init_state()).aux_loss))(scores)  # through P_j only
    np.testing.assert_allclose(grad, np.broadcast_to(0.1 * 8 * f / 16, (16, 8)), rtol=1e-6)


def test_aux_loss_positive_and_minimal_at_uniform():
    e, k = 8, 2
    r = make_router("softmax_topk_aux", e, k)  # alpha = 1e-2
    loss = jax.jit(lambda s: r.route(s, r.init_state()).aux_loss)
    # Balanced: token i prefers experts i, i+1 (mod E) with the same score profile, so f_j = P_j = 1/E.
    logits = jnp.stack([jnp.roll(jnp.array([3.0, 2.0] + [0.0] * (e - 2)), i) for i in range(e)])
    uniform = loss(jax.nn.softmax(logits, axis=1))
    np.testing.assert_allclose(uniform, 1e-2, rtol=1e-5)
    noise = jax.random.normal(jax.random.PRNGKey(1), (1024, e))
    losses = [float(loss(jax.nn.softmax(noise + jnp.linspace(-spread, spread, e), axis=1)))
              for spread in (0.5, 1.0, 2.0, 4.0)]
    assert all(loss > 1e-2 for loss in losses) and losses == sorted(losses)


# ------------------------------------------------------------------------------- quantile estimators

def _np_upper_quantile(pooled, top_k):
    """(q+1)-th largest per column, q = floor(n·k/E): the slow truth."""
    n, e = pooled.shape
    return -np.sort(-pooled, axis=0)[(n * top_k) // e]


@pytest.mark.parametrize("window,steps,n", [(1, 2, 50), (3, 2, 50), (3, 5, 50), (2, 3, 7)])
def test_exact_window_quantile_matches_numpy(window, steps, n):
    e, k = 8, 3
    win = routing._make_window(e, k, window, "exact", 2, (0.0, 1.0), None)
    buf, push = win.init(n), jax.jit(win.push)
    batches = [np.asarray(jax.random.normal(jax.random.PRNGKey(s), (n, e))) for s in range(steps)]
    for step, values in enumerate(batches):
        buf = push(buf, jnp.int32(step), values)
    got = jax.jit(win.quantile, static_argnums=2)(buf, jnp.int32(steps), n)
    np.testing.assert_array_equal(got, _np_upper_quantile(np.concatenate(batches[-window:]), k))


@pytest.mark.parametrize("window,bins", [(1, 64), (4, 256)])
def test_histogram_quantile_error_within_bin_width(window, bins):
    e, k, n, value_range = 32, 4, 1000, (-1.0, 1.0)
    hist_win = routing._make_window(e, k, window, "histogram", bins, value_range, None)
    buf, push = hist_win.init(None), jax.jit(hist_win.push)
    batches = [np.asarray(jnp.tanh(jax.random.normal(jax.random.PRNGKey(s), (n, e)) * 0.5 + 0.1 * s))
               for s in range(window + 2)]
    for step, values in enumerate(batches):
        buf = push(buf, jnp.int32(step), values)
    exact = _np_upper_quantile(np.concatenate(batches[-window:]), k)
    err = np.abs(np.asarray(jax.jit(hist_win.quantile, static_argnums=2)(buf, jnp.int32(len(batches)), n))
                 - exact)
    assert err.max() <= 2.0 / bins, err.max()


# ------------------------------------------------------------------------------------------ quantile

def test_quantile_bias_matches_numpy_rule():
    """b <- (1-r)·b + r·(b_hat - mean b_hat), b_hat = -(q+1)-th largest of s - alpha over the window."""
    e, k, n, window, rate = 8, 2, 40, 2, 0.5
    r = make_router("quantile", e, k, window=window, rate=rate)
    state = r.init_state(num_tokens=n)
    margins, step_fn = [], jax.jit(lambda st, s: r.update(st, s, r.route(s, st)))
    for step in range(4):
        s = skewed_scores(jax.random.PRNGKey(step), n, e)
        bias = np.asarray(state["bias"])  # the bias this batch is routed with
        state = step_fn(state, s)
        cutoff = -np.sort(-(np.asarray(s) + bias), axis=1)[:, k]
        margins.append(np.asarray(s) - cutoff[:, None])
        b_hat = -_np_upper_quantile(np.concatenate(margins[-window:]), k)
        np.testing.assert_allclose(state["bias"], (1 - rate) * bias + rate * (b_hat - b_hat.mean()), atol=1e-6)


def test_quantile_same_batch_converges_to_exact_balance():
    """Re-routing one batch: each update is exact for fixed cutoffs; moving cutoffs leave a shrinking rest."""
    e, k, n = 64, 4, 4096
    r = make_router("quantile", e, k, window=1)
    s = skewed_scores(jax.random.PRNGKey(1), n, e)

    def again(state, _):
        out = r.route(s, state)
        return r.update(state, s, out), out.stats["max_vio"]
    _, max_vio = jax.jit(lambda st: jax.lax.scan(again, st, None, length=16))(r.init_state(num_tokens=n))
    assert max_vio[0] > 3 and max_vio[1] < max_vio[0] / 10 and max_vio[-1] < 0.03, max_vio


@pytest.mark.parametrize("options", [{}, {"stats": "histogram"}])
def test_quantile_balances_skewed_router(options):
    r = make_router("quantile", 64, 4, **options)
    _, stats = simulate(r, 8192, 20, jax.random.PRNGKey(0))
    assert stats["max_vio"][0] > 3 and float(jnp.mean(stats["max_vio"][10:20])) < 0.15, stats["max_vio"]


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"stats": "histogram"}])
def test_quantile_balances_skewed_router_512_experts(options):
    r = make_router("quantile", 512, 16, **options)
    _, stats = simulate(r, 16384, 20, jax.random.PRNGKey(0))
    assert stats["max_vio"][0] > 3 and float(jnp.mean(stats["max_vio"][10:20])) < 0.20, stats["max_vio"]


# ------------------------------------------------------------------------------------ other routers

def test_bias_sign_lowers_max_vio_slowly():
    r = make_router("bias_sign", 64, 4)  # gamma = 1e-3
    state, stats = simulate(r, 1024, 200, jax.random.PRNGKey(0))
    first, last = float(jnp.mean(stats["max_vio"][:10])), float(jnp.mean(stats["max_vio"][-10:]))
    assert last < first / 2 and last > 0.2, (first, last)  # better, still far from the sampling floor
    assert float(jnp.max(jnp.abs(state["bias"]))) <= 200 * 1e-3 + 1e-6


def test_expert_threshold_variable_experts():
    e, k, n = 64, 4, 8192
    r = make_router("expert_threshold", e, k)  # k_max = 8
    state, stats = simulate(r, n, 12, jax.random.PRNGKey(0))
    assert float(stats["experts_per_token"][0]) == k  # first batch: plain top-k
    assert float(jnp.max(jnp.abs(stats["experts_per_token"][4:] - k))) < 0.05 * k
    assert float(jnp.mean(stats["max_vio"][4:])) < 0.2

    s = skewed_scores(jax.random.PRNGKey(99), n, e)
    out = jax.jit(r.route)(s, state)
    active = np.asarray(out.mask).sum(1)
    assert active.min() >= 1 and active.max() <= 2 * k
    passing = (np.asarray(s) + np.asarray(state["bias"]) > 0).sum(1)
    np.testing.assert_array_equal(active, np.clip(passing, 1, 2 * k))
    np.testing.assert_allclose(out.stats["capped_fraction"], np.mean(passing > 2 * k), atol=1e-6)
    np.testing.assert_allclose(out.stats["floored_fraction"], np.mean(passing == 0), atol=1e-6)
    assert 0 < float(out.stats["capped_fraction"]) and 0 < float(out.stats["floored_fraction"])


def test_expert_threshold_cap_and_floor():
    r = make_router("expert_threshold", 8, 2, k_max=3)
    s = jax.random.uniform(jax.random.PRNGKey(0), (32, 8))
    state, route = r.init_state(num_tokens=32) | {"step": jnp.int32(1)}, jax.jit(r.route)
    low = route(s, state | {"bias": jnp.ones(8)})  # every expert passes: capped at the 3 best
    assert bool(jnp.all(low.mask)) and float(low.stats["capped_fraction"]) == 1.0
    np.testing.assert_array_equal(low.expert_ids, jax.lax.top_k(s, 3)[1])
    tau = jnp.linspace(1.0, 1.7, 8)
    high = route(s, state | {"bias": -tau})  # none passes: one expert, the argmax of s - tau
    assert bool(jnp.all(high.mask.sum(1) == 1)) and float(high.stats["floored_fraction"]) == 1.0
    np.testing.assert_array_equal(high.expert_ids[:, 0], jnp.argmax(s - tau, axis=1))


# ----------------------------------------------------------------------------------------- causality

@pytest.mark.parametrize("name,options", ALL_ROUTERS)
def test_contract_and_causality(name, options):
    """Shapes, masks and stats under jit; batch t is routed with state from batches < t only, and each token
    by its own scores alone."""
    e, k, n, t = 16, 2, 64, 3
    r = make_router(name, e, k, **options)

    @jax.jit
    def step(state, s):
        out = r.route(s, state)
        return r.update(state, s, out), out

    batches = [skewed_scores(jax.random.PRNGKey(i), n, e) for i in range(t + 2)]
    changed = list(batches)
    changed[t] = batches[t].at[n // 2:].set(jax.random.uniform(jax.random.PRNGKey(50), (n - n // 2, e)))
    runs = []
    for seq in (batches, changed):
        state, outs, states = r.init_state(num_tokens=n), [], []
        for s in seq:
            states.append(state)
            state, out = step(state, s)
            outs.append(out)
        runs.append((states, outs))
    (states_a, outs_a), (states_b, outs_b) = runs

    out, k_out = outs_a[t], (4 if name == "expert_threshold" else k)
    assert r.k_out == k_out
    chex.assert_shape([out.expert_ids, out.weights, out.mask], (n, k_out))
    chex.assert_type([out.expert_ids, out.weights, out.mask], [jnp.int32, jnp.float32, jnp.bool_])
    assert bool(jnp.all(out.mask | (out.weights == 0)))
    assert bool(jnp.all(out.mask)) or name == "expert_threshold"
    np.testing.assert_allclose(jnp.sum(out.stats["load"]), 1.0, rtol=1e-6)
    assert ("max_vio_window" in out.stats) == (name in ("quantile", "expert_threshold"))

    chex.assert_trees_all_equal(states_a[t], states_b[t])
    for field in ("expert_ids", "weights", "mask"):  # unchanged tokens of batch t route identically
        np.testing.assert_array_equal(getattr(outs_a[t], field)[:n // 2], getattr(outs_b[t], field)[:n // 2])
    if name != "softmax_topk_aux":  # stateful routers: batch t reaches batch t+1 only through the update
        assert not np.array_equal(states_a[t + 1]["bias"], states_b[t + 1]["bias"])


# ------------------------------------------------------------------------------ jit and data shards

@pytest.mark.slow
@pytest.mark.parametrize("name,options", [("quantile", {}), ("expert_threshold", {"stats": "histogram"})])
def test_eager_matches_jit(name, options):
    """JAX_DISABLE_JIT debugging runs the same code path (routers without windows are covered by the rest)."""
    e, k, n = 8, 2, 16
    r = make_router(name, e, k, **options)
    state = simulate(r, n, 3, jax.random.PRNGKey(7))[0]
    s = skewed_scores(jax.random.PRNGKey(5), n, e)
    with jax.disable_jit():
        out = r.route(s, state)
        new = r.update(state, s, out)
    out_j = jax.jit(r.route)(s, state)
    chex.assert_trees_all_close(out_j, out, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(jax.jit(r.update)(state, s, out_j), new, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,options", [("softmax_topk_aux", {}), ("bias_sign", {}),
                                          ("quantile", {"stats": "histogram"}),
                                          ("expert_threshold", {"stats": "histogram"})])
def test_data_shards_match_one_batch(name, options):
    """With axis_name, stats and the updated state over 2 shards equal those of the whole batch."""
    e, k, n, shards = 16, 2, 64, 2
    whole = make_router(name, e, k, **options)
    sharded = make_router(name, e, k, axis_name="data", **options)

    def step(router, state, s):
        out = router.route(s, state)
        return out, router.update(state, s, out)
    whole_step = jax.jit(functools.partial(step, whole))
    state = whole.init_state()
    for i in range(3):  # warm up, so that the bias and the windows are not trivial
        state = whole_step(state, skewed_scores(jax.random.PRNGKey(i), n, e))[1]
    s = skewed_scores(jax.random.PRNGKey(5), n, e)
    out, new = whole_step(state, s)
    out_sh, new_sh = jax.jit(jax.vmap(functools.partial(step, sharded, state), axis_name="data"))(
        s.reshape(shards, n // shards, e))
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)
    chex.assert_trees_all_close(first(out_sh.stats), out.stats, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out_sh.aux_loss[0], out.aux_loss, rtol=1e-5)
    chex.assert_trees_all_close(first(new_sh), new, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(first(new_sh), jax.tree.map(lambda x: x[1], new_sh))


# --------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("args,options,message", [
    (("top2", 8, 2), {}, "router name must be one of"),
    (("bias_sign", 8, 2), {"alpha": 0.1}, "options of router 'bias_sign' must be a subset"),
    (("bias_sign", 1, 1), {}, "num_experts must be an int >= 2, got 1"),
    (("bias_sign", 8, 0), {}, "top_k must be an int in [1, 8], got 0"),
    (("bias_sign", 8, 9), {}, "top_k must be an int in [1, 8], got 9"),
    (("quantile", 8, 8), {}, "top_k must be an int in [1, 7], got 8"),
    (("softmax_topk_aux", 8, 2), {"alpha": -1.0}, "alpha must be in [0, inf), got -1.0"),
    (("bias_sign", 8, 2), {"gamma": 0.0}, "gamma must be in (0, inf), got 0.0"),
    (("quantile", 8, 2), {"rate": 0.0}, "rate must be in (0, 1], got 0.0"),
    (("quantile", 8, 2), {"rate": 1.5}, "rate must be in (0, 1], got 1.5"),
    (("quantile", 8, 2), {"window": 0}, "window must be an int >= 1, got 0"),
    (("expert_threshold", 8, 2), {"window": 2.0}, "window must be an int >= 1, got 2.0"),
    (("quantile", 8, 2), {"stats": "approx"}, 'stats must be in {"exact", "histogram"}, got \'approx\''),
    (("quantile", 8, 2), {"bins": 1}, "bins must be an int >= 2, got 1"),
    (("quantile", 8, 2), {"margin_range": (1.0, -1.0)}, "margin_range must be a pair (lo, hi)"),
    (("expert_threshold", 8, 2), {"score_range": (0.0,)}, "score_range must be a pair (lo, hi)"),
    (("expert_threshold", 8, 2), {"k_max": 1}, "k_max must be an int in [2, 8], got 1"),
    (("expert_threshold", 8, 2), {"k_max": 9}, "k_max must be an int in [2, 8], got 9"),
    (("bias_sign", 8, 2), {"axis_name": 3}, "axis_name must be None, a mesh axis name"),
    (("quantile", 8, 2), {"axis_name": "data"}, 'stats must be "histogram" when axis_name is set'),
])
def test_validation_errors(args, options, message):
    with pytest.raises(ValueError) as info:
        make_router(*args, **options)
    assert message in str(info.value), str(info.value)


def test_exact_window_needs_num_tokens():
    r = make_router("quantile", 8, 2)
    with pytest.raises(ValueError, match='num_tokens must be given to init_state when stats="exact"'):
        r.init_state()
    with pytest.raises(ValueError, match="num_tokens must be an int >= 1, got 0"):
        r.init_state(num_tokens=0)
    state = r.init_state(num_tokens=64)
    s = jnp.full((32, 8), 0.5)
    with pytest.raises(ValueError, match="the batch's token count must be the num_tokens given to init_state"):
        jax.jit(lambda st, s: r.update(st, s, r.route(s, st)))(state, s)
