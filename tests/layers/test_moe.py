"""MoE against a dense all-experts computation, capacity dropping, router state handling, gradients."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.config import MoEConfig, RouterConfig
from hybridmoe.layers.moe import DenseFFN, MoE, expert_capacity
from hybridmoe.routing import make_router

B, T, D = 2, 8, 16
EPS = 1e-6


def _normal(seed, shape):
    # numpy, not jax.random: eager jax.random compiles a program per shape (seconds on a shared CPU).
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _cfg(**kw):
    base = dict(num_experts=8, top_k=2, num_shared_experts=0, expert_width=12, capacity_factor=100.0)
    return MoEConfig(**{**base, **kw})


def _x(seed=0):
    return _normal(seed, (B, T, D))


def random_variables(module, *args, seed=0):
    """Variables at the shapes (and logical axes) `init` creates; params drawn with numpy.

    The tests need parameter values, not init's distribution; this skips compiling init's random ops,
    which costs seconds per shape on a shared CPU. Kernels ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.1²).
    The router state is the router's own fresh state (what `init` stores: checked in a test below).
    """
    rng = np.random.default_rng(seed)

    def draw(s):
        if s.ndim == 1:
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(s.shape), s.dtype)
        fan_in = s.size // s.shape[-1] // (s.shape[0] if s.ndim == 3 else 1)  # [E, in, out] or [in, out]
        return jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(fan_in), s.dtype)

    shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), *args)
    variables = {"params": jax.tree.map(draw, shapes["params"])}
    if "router" in shapes:
        cfg = module.config
        router = make_router(module.router.name, cfg.num_experts, cfg.top_k, **module.router.options())
        variables["router"] = {"state": router.init_state(num_tokens=B * T)}
    return variables


def _init(cfg, router_cfg, x):
    module = MoE(cfg, router_cfg, D, norm_eps=EPS)
    return module, random_variables(module, x)


def _glu(g, u, activation):
    if activation == "swiglu":
        return g * jax.nn.sigmoid(g) * u
    return 4 * jnp.tanh(g / 4) * jax.nn.sigmoid(g) * 25 * jnp.tanh(u / 25)


def _ffn(p, x, activation):
    return _glu(x @ p["w_gate"]["kernel"], x @ p["w_up"]["kernel"], activation) @ p["w_down"]["kernel"]


def dense_reference(params, router_state, x, cfg, router_cfg, keep_fn=None):
    """Every expert on every token, mixed by a dense [N, E] weight matrix. Tokens in (b, t) order.

    keep_fn(ids, mask) -> mask: optionally removes assignments (to model capacity drops).
    """
    p = nn.unbox(params)
    tokens = x.reshape(-1, D)
    logits = tokens @ p["w_router"]
    scores = jax.nn.sigmoid(logits) if cfg.score_fn == "sigmoid" else jax.nn.softmax(logits, -1)
    router = make_router(router_cfg.name, cfg.num_experts, cfg.top_k, **router_cfg.options())
    out = router.route(scores, router_state)
    w = jnp.where(out.mask, out.weights, 0.0)
    w = w / w.sum(-1, keepdims=True) * cfg.routed_scaling
    mask = out.mask if keep_fn is None else keep_fn(out.expert_ids, out.mask)
    dense_w = jnp.einsum("nke,nk->ne", jax.nn.one_hot(out.expert_ids, cfg.num_experts), w * mask)
    h = tokens @ p["latent_down"]["kernel"] if cfg.latent_dim else tokens
    every = jnp.stack([_glu(h @ p["w_gate"][e], h @ p["w_up"][e], cfg.activation) @ p["w_down"][e]
                       for e in range(cfg.num_experts)])  # [E, N, d]
    y = jnp.einsum("ne,end->nd", dense_w, every)
    if cfg.latent_dim:
        y = y / jnp.sqrt(jnp.mean(y * y, -1, keepdims=True) + EPS) * p["latent_norm"]["scale"]
        y = y @ p["latent_up"]["kernel"]
    if cfg.num_shared_experts:
        y = y + _ffn(p["shared"], tokens, cfg.activation)
    return y.reshape(x.shape)


CASES = {
    "swiglu": (_cfg(), RouterConfig()),
    "situ_softmax_shared": (_cfg(activation="situ", score_fn="softmax", num_shared_experts=2,
                                 routed_scaling=2.5), RouterConfig("softmax_topk_aux")),
    "latent_shared": (_cfg(latent_dim=8, num_shared_experts=1), RouterConfig()),
    "situ_latent_threshold": (_cfg(activation="situ", latent_dim=8, num_shared_experts=1),
                              RouterConfig("expert_threshold", k_max=4)),
    "dropless_tiny_cf": (_cfg(dispatch="dropless", capacity_factor=0.1), RouterConfig()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dispatch_matches_dense_all_experts(case):
    cfg, router_cfg = CASES[case]
    x = _x()
    module, variables = _init(cfg, router_cfg, x)
    # A non-trivial bias so selection by s + b differs from plain top-k of s.
    state = variables["router"]["state"]
    state = {**state, "bias": 0.3 * _normal(2, state["bias"].shape)}
    variables = {**variables, "router": {"state": state}}
    y, aux = module.apply(variables, x)
    want = dense_reference(variables["params"], state, x, cfg, router_cfg)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert float(aux["router_stats"]["dropped_fraction"]) == 0.0


def _causal_keep(capacity):
    """Keeps, per expert, the first `capacity` active assignments in (t, b, slot) order."""
    def keep_fn(ids, mask):
        ids, mask = np.asarray(ids), np.asarray(mask)
        keep = np.zeros_like(mask)
        used = np.zeros(ids.max() + 1, int)
        for t in range(T):
            for b in range(B):
                n = b * T + t
                for j in range(ids.shape[1]):
                    if mask[n, j] and used[ids[n, j]] < capacity:
                        keep[n, j] = True
                        used[ids[n, j]] += 1
        return jnp.asarray(keep)
    return keep_fn


def test_capacity_drops_latest_tokens_and_counts_them():
    cfg, router_cfg = _cfg(capacity_factor=0.5, num_shared_experts=1), RouterConfig()
    x = _x(3)
    module, variables = _init(cfg, router_cfg, x)
    capacity = expert_capacity(B * T, cfg.top_k, cfg.num_experts, cfg.capacity_factor)
    assert capacity == 2
    y, aux = module.apply(variables, x)
    keep_fn = _causal_keep(capacity)
    want = dense_reference(variables["params"], variables["router"]["state"], x, cfg, router_cfg, keep_fn)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # The expected count, from the router's own choices.
    p = nn.unbox(variables["params"])
    router = make_router(router_cfg.name, cfg.num_experts, cfg.top_k, **router_cfg.options())
    out = router.route(jax.nn.sigmoid(x.reshape(-1, D) @ p["w_router"]), variables["router"]["state"])
    kept = np.asarray(keep_fn(out.expert_ids, out.mask)).sum()
    dropped = 1 - kept / (B * T * cfg.top_k)
    assert dropped > 0.2
    np.testing.assert_allclose(aux["router_stats"]["dropped_fraction"], dropped, rtol=1e-6)


def test_capacity_dropping_is_causal_bitwise():
    cfg, router_cfg = _cfg(capacity_factor=0.5, num_shared_experts=1), RouterConfig()
    x = _x(4)
    module, variables = _init(cfg, router_cfg, x)
    tau = 3
    x2 = x.at[:, tau + 1:].add(3.0 * _normal(5, (B, T - tau - 1, D)))
    (y1, aux1), (y2, _) = module.apply(variables, x), module.apply(variables, x2)
    assert float(aux1["router_stats"]["dropped_fraction"]) > 0.2
    np.testing.assert_array_equal(np.asarray(y1[:, :tau + 1]), np.asarray(y2[:, :tau + 1]))
    assert not np.allclose(y1[:, tau + 1:], y2[:, tau + 1:])


def test_router_state_is_a_collection_updated_only_when_mutable():
    cfg, router_cfg = _cfg(), RouterConfig("bias_sign", gamma=1.0)
    x = _x(6)
    module, variables = _init(cfg, router_cfg, x)
    router = make_router(router_cfg.name, cfg.num_experts, cfg.top_k, **router_cfg.options())
    shapes = jax.eval_shape(module.init, jax.random.PRNGKey(1), x)
    assert set(shapes) == {"params", "router"}
    params_flat = jax.tree_util.tree_flatten_with_path(shapes["params"])[0]
    assert not any("state" in jax.tree_util.keystr(path) or "bias" in jax.tree_util.keystr(path)
                   for path, _ in params_flat)
    # The real init stores the router's fresh state (jit drops the unused param init: cheap).
    init_state = jax.jit(lambda key, x: module.init(key, x)["router"]["state"])(jax.random.PRNGKey(1), x)
    old = variables["router"]["state"]
    jax.tree.map(np.testing.assert_array_equal, init_state, old)

    y_frozen, _ = module.apply(variables, x)  # not mutable: nothing returned, nothing written
    (y_mut, _), new_vars = module.apply(variables, x, mutable=["router"])
    np.testing.assert_array_equal(y_frozen, y_mut)  # this call routed with the OLD state
    p = nn.unbox(variables["params"])
    scores = jax.nn.sigmoid(x.swapaxes(0, 1).reshape(-1, D) @ p["w_router"])
    want = router.update(old, scores, router.route(scores, old))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), new_vars["router"]["state"], want)
    assert not np.allclose(new_vars["router"]["state"]["bias"], old["bias"])
    # The next batch sees the new state.
    y_next, _ = module.apply({**variables, **new_vars}, x)
    assert not np.allclose(y_next, y_frozen)


def test_gradients_reach_router_and_experts():
    cfg, router_cfg = _cfg(num_shared_experts=1, latent_dim=8), RouterConfig()
    x = _x(7)
    module, variables = _init(cfg, router_cfg, x)
    params, state = variables["params"], variables["router"]["state"]
    probe = _normal(8, x.shape)

    def loss(params):
        y, _ = module.apply({"params": params, "router": {"state": state}}, x)
        return jnp.sum(y * probe)

    def ref_loss(params):
        return jnp.sum(dense_reference(params, state, x, cfg, router_cfg) * probe)

    # jit: one compile per gradient beats compiling every backward op eagerly.
    grads = nn.unbox(jax.jit(jax.grad(loss))(params))
    ref_grads = nn.unbox(jax.jit(jax.grad(ref_loss))(params))
    for name in ("w_router", "w_gate", "w_up", "w_down"):
        assert float(jnp.abs(grads[name]).max()) > 0, name
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads, ref_grads)


@pytest.mark.parametrize("activation", ["swiglu", "situ"])
def test_dense_ffn(activation):
    x = _x(9)
    module = DenseFFN(width=20, d_model=D, activation=activation)
    variables = random_variables(module, x)
    want = _ffn(nn.unbox(variables["params"]), x, activation)
    np.testing.assert_allclose(module.apply(variables, x), want, rtol=1e-5, atol=1e-5)


def test_every_param_has_logical_axes():
    module, variables = _init(_cfg(latent_dim=8, num_shared_experts=1), RouterConfig(), _x())
    leaves = jax.tree.leaves(variables["params"], is_leaf=lambda a: isinstance(a, nn.Partitioned))
    assert leaves and all(isinstance(a, nn.Partitioned) and len(a.names) == a.value.ndim for a in leaves)
    assert variables["params"]["w_router"].names == ("embed", "expert")
    assert variables["params"]["w_router"].value.dtype == jnp.float32
    assert variables["params"]["w_gate"].names == ("expert", "latent", "mlp")


def test_dropless_rejects_a_capacity():
    from hybridmoe.layers.moe import dispatch_dropless
    with pytest.raises(ValueError, match="capacity=None"):
        dispatch_dropless(jnp.zeros((4, 2)), jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1)),
                          jnp.ones((4, 1), bool), None, activation="swiglu", capacity=3)


@pytest.mark.parametrize("chunk", [5, 4])
def test_chunked_dropless_dispatch_equals_one_pass(chunk):
    """dispatch_chunk changes where the work runs, not what it computes: outputs, router stats and
    gradients match the unchunked layer (B·T = 16: chunk 5 pads the last chunk, chunk 4 does not)."""
    router_cfg = RouterConfig(name="quantile")
    whole, chunked = _cfg(dispatch="dropless"), _cfg(dispatch="dropless", dispatch_chunk=chunk)
    assert B * T > chunk
    x, probe = _x(11), _normal(12, (B, T, D))
    module, variables = _init(whole, router_cfg, x)

    def run(cfg):
        m = MoE(cfg, router_cfg, D, norm_eps=EPS)

        def loss(params):
            (y, aux), upd = m.apply({"params": params, "router": variables["router"]}, x, mutable=["router"])
            return jnp.sum(y * probe), (y, aux["router_stats"], upd)
        return jax.jit(jax.grad(loss, has_aux=True))(variables["params"])

    (g_whole, out_whole), (g_chunk, out_chunk) = run(whole), run(chunked)
    jaxpr = lambda cfg: str(jax.make_jaxpr(lambda p: MoE(cfg, router_cfg, D, norm_eps=EPS).apply(  # noqa: E731
        {"params": p, "router": variables["router"]}, x))(variables["params"]))
    assert "scan" in jaxpr(chunked) and "scan" not in jaxpr(whole)  # the chunked path really ran
    np.testing.assert_allclose(out_chunk[0], out_whole[0], rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), out_chunk[1:], out_whole[1:])
    assert float(jnp.abs(nn.unbox(g_chunk)["w_gate"]).max()) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), nn.unbox(g_chunk),
                 nn.unbox(g_whole))


def test_dispatch_chunk_needs_dropless():
    with pytest.raises(ValueError, match="MoEConfig.dispatch_chunk.*dropless"):
        _cfg(dispatch="capacity", dispatch_chunk=64)
    with pytest.raises(ValueError, match="MoEConfig.dispatch_chunk"):
        _cfg(dispatch="dropless", dispatch_chunk=-1)
