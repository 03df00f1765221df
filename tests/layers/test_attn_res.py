"""Attention residuals (DESIGN §3.4): the mix against its naive truth; the stream's bookkeeping."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.config import AttnResConfig
from hybridmoe.layers.attn_res import AttnResSite, ResidualStream, attn_res_mix
from hybridmoe.layers.common import rms_normalize

B, T, D = 2, 5, 16


# Test data comes from NumPy: every new shape drawn with jax.random would cost an eager compile.
def _normal(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _sources(s: int, seed: int = 0, dtype=jnp.float32) -> jax.Array:
    """[S, B, T, D] with per-source scales that differ, so the RMS normalisation matters."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.standard_normal((s, 1, 1, 1)))
    return jnp.asarray(rng.standard_normal((s, B, T, D)) * scale, dtype)


def _params(seed: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(D), jnp.float32),
            jnp.asarray(1.0 + 0.5 * rng.standard_normal(D), jnp.float32))


def _naive_mix(sources, query, scale, eps=1e-6):
    """The definition, written out: scaled normed keys, logits, fp32 softmax, weighted raw sum."""
    keys = rms_normalize(sources, eps) * scale
    logits = jnp.einsum("sbtd,d->sbt", keys, query)
    weights = jax.nn.softmax(logits, axis=0)
    return jnp.einsum("sbt,sbtd->btd", weights, sources.astype(jnp.float32)).astype(sources.dtype)


def _site_fn(params):
    return lambda srcs: AttnResSite().apply({"params": params}, srcs)


# ---------------------------------------------------------------- the mix


@pytest.mark.parametrize("s", [2, 3, 4, 7])
def test_zero_query_site_is_plain_mean(s):
    src = _sources(s, seed=s)
    site = AttnResSite()
    variables = jax.jit(site.init)(jax.random.key(0), list(src))
    out = jax.jit(site.apply)(variables, list(src))
    mean = jnp.mean(src, axis=0)
    if s & (s - 1) == 0:  # weights 1/s are exact powers of two: the mean, bit for bit
        np.testing.assert_array_equal(out, mean)
    else:
        np.testing.assert_allclose(out, mean, rtol=1e-6, atol=1e-6)


def test_mix_matches_naive_reference_values_and_gradients():
    src = _sources(5, seed=1)
    query, scale = _params(2)
    np.testing.assert_allclose(attn_res_mix(src, query, scale), _naive_mix(src, query, scale),
                               rtol=1e-5, atol=1e-6)
    cot = _normal(3, B, T, D)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * cot)

    got = jax.jit(jax.grad(loss(attn_res_mix), argnums=(0, 1, 2)))(src, query, scale)
    want = jax.jit(jax.grad(loss(_naive_mix), argnums=(0, 1, 2)))(src, query, scale)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_list_of_sources_equals_stacked_sources():
    src = _sources(4, seed=13)
    query, scale = _params(14)
    mix = jax.jit(attn_res_mix)
    np.testing.assert_array_equal(mix(list(src), query, scale), mix(src, query, scale))


def test_permuting_sources_leaves_output_unchanged():
    src = _sources(6, seed=4)
    query, scale = _params(5)
    perm = jnp.array([3, 0, 5, 1, 4, 2])
    np.testing.assert_allclose(attn_res_mix(src[perm], query, scale),
                               attn_res_mix(src, query, scale), rtol=1e-6, atol=1e-6)


def test_gradients_reach_query_and_key_norm():
    src = list(_sources(3, seed=6))
    site = AttnResSite()
    params = nn.unbox(site.init(jax.random.key(0), src)["params"])
    cot = _normal(7, B, T, D)

    @jax.jit
    @jax.grad
    def grad(p):
        return jnp.sum(site.apply({"params": p}, src) * cot)

    g0 = grad(params)
    assert float(jnp.max(jnp.abs(g0["query"]))) > 1e-3
    # At a zero query the logits are (n ⊙ scale) · 0: the scale's gradient is exactly zero there.
    np.testing.assert_array_equal(g0["key_norm"], 0.0)
    moved = {**params, "query": params["query"] - 0.1 * g0["query"]}
    g1 = grad(moved)
    assert float(jnp.max(jnp.abs(g1["key_norm"]))) > 1e-4
    assert float(jnp.max(jnp.abs(g1["query"]))) > 1e-3


def _eqns(jaxpr):
    """All equations of a jaxpr, sub-jaxprs (custom_jvp, pjit) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    yield from _eqns(inner)
                elif hasattr(sub, "eqns"):
                    yield from _eqns(sub)


def test_softmax_is_fp32_for_bf16_sources():
    src = _sources(4, seed=8, dtype=jnp.bfloat16)
    query, scale = _params(9)
    jaxpr = jax.make_jaxpr(attn_res_mix)(src, query, scale).jaxpr
    softmax_ops = [e for e in _eqns(jaxpr) if e.primitive.name in ("exp", "reduce_max")]
    assert softmax_ops
    assert all(v.aval.dtype == jnp.float32 for e in softmax_ops for v in e.outvars)
    out = attn_res_mix(src, query, scale)
    assert out.dtype == jnp.bfloat16
    # bf16 sources are mixed exactly as their fp32 upcast, rounded once at the end.
    upcast = attn_res_mix(src.astype(jnp.float32), query, scale).astype(jnp.bfloat16)
    np.testing.assert_array_equal(out.astype(jnp.float32), upcast.astype(jnp.float32))


def test_site_parameters_and_single_source():
    src = list(_sources(3, seed=10))
    boxed = AttnResSite().init(jax.random.key(0), src)["params"]
    assert boxed["query"].names == ("embed",) and boxed["key_norm"].names == ("norm",)
    params = nn.unbox(boxed)
    np.testing.assert_array_equal(params["query"], jnp.zeros(D))
    np.testing.assert_array_equal(params["key_norm"], jnp.ones(D))
    # One source: a softmax over one entry is 1, so no (gradient-less) parameters are made.
    assert AttnResSite().init(jax.random.key(0), src[:1]) == {}
    np.testing.assert_array_equal(AttnResSite().apply({}, src[:1]), src[0])


# ---------------------------------------------------------------- the stream


def _run_stream(mode: str, num_layers: int, block_size: int = 4, final: str = "attn_res",
                seed: int = 0):
    """Drives a stream like HybridLM does; the sites record their sources and return their mean.

    Returns (inputs seen by each sublayer, sources given to each site, final output, outputs,
    embedding, the number of sources after every step).
    """
    cfg = AttnResConfig(mode=mode, block_size=block_size, final=final)
    emb = _normal(seed, B, T, D)
    outputs = list(_normal(seed + 1, 2 * num_layers, B, T, D))
    seen_sources: list[list[jax.Array]] = []

    def recorder(srcs):
        seen_sources.append(list(srcs))
        return jnp.mean(jnp.stack(srcs), axis=0)

    site = None if mode == "none" else recorder
    stream = ResidualStream(cfg, emb)
    inputs, counts = [], [stream.num_sources]
    for i in range(num_layers):
        for j in range(2):
            inputs.append(stream.sublayer_input(site))
            stream.add(outputs[2 * i + j])
            counts.append(stream.num_sources)
        stream.end_layer(i)
        counts.append(stream.num_sources)
    final_out = stream.final(site)
    return inputs, seen_sources, final_out, outputs, emb, counts


def test_mode_none_is_embedding_plus_outputs():
    inputs, seen, final, outputs, emb, counts = _run_stream("none", 3)
    assert not seen and set(counts) == {1}
    x = emb
    for k, y in enumerate(outputs):
        np.testing.assert_array_equal(inputs[k], x)
        x = x + y
    np.testing.assert_array_equal(final, x)


@pytest.mark.parametrize("mode", ["block", "full"])
def test_final_stream_is_what_mode_none_carries(mode):
    *_, final_none, _, _, _ = _run_stream("none", 5)
    _, seen, final, *_ = _run_stream(mode, 5, block_size=2, final="stream")
    assert len(seen) == 10  # sublayer sites only; the final site is not called
    np.testing.assert_array_equal(final, final_none)


@pytest.mark.parametrize("num_layers,block_size", [(5, 2), (6, 3), (4, 1), (3, 8)])
def test_block_sources_are_embedding_block_sums_and_partial(num_layers, block_size):
    _, seen, _, outputs, emb, _ = _run_stream("block", num_layers, block_size)
    per_layer = [outputs[2 * i] + outputs[2 * i + 1] for i in range(num_layers)]
    for k, srcs in enumerate(seen):  # k = 2·layer + sublayer; the last entry is the final site
        layer, sub = divmod(k, 2)
        start = (min(layer, num_layers) // block_size) * block_size  # first layer of this block
        finished = [sum(per_layer[b * block_size:(b + 1) * block_size])
                    for b in range(start // block_size)]
        partial = per_layer[start:layer] + ([outputs[k - 1]] if sub else [])
        want = [emb, *finished] + ([sum(partial)] if partial else [])
        assert len(srcs) == len(want), (k, len(srcs), len(want))
        for got, w in zip(srcs, want):
            np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6)


def test_full_sources_are_embedding_and_every_output():
    _, seen, _, outputs, emb, counts = _run_stream("full", 3)
    for k, srcs in enumerate(seen):  # 6 sublayers, then the final site over all 7
        assert len(srcs) == k + 1
        for got, want in zip(srcs, [emb, *outputs[:k]]):
            assert got is want
    assert counts[-1] == 7


def test_block_with_one_block_mixes_embedding_and_partial():
    cfg = AttnResConfig(mode="block", block_size=4)
    emb, y0 = _normal(11, 2, B, T, D)
    query, scale = _params(12)
    site = _site_fn({"query": query, "key_norm": scale})
    stream = ResidualStream(cfg, emb)
    np.testing.assert_array_equal(stream.sublayer_input(site), emb)  # one source: itself
    stream.add(y0)
    np.testing.assert_array_equal(stream.sublayer_input(site),
                                  attn_res_mix(jnp.stack([emb, y0]), query, scale))


@pytest.mark.parametrize("num_layers,block_size", [(8, 4), (6, 4), (5, 2), (4, 1), (3, 8)])
def test_source_counts(num_layers, block_size):
    *_, counts = _run_stream("block", num_layers, block_size)
    assert max(counts) <= num_layers / block_size + 2
    *_, counts = _run_stream("full", num_layers)
    assert counts[-1] == max(counts) == 2 * num_layers + 1


def test_site_must_match_mode():
    emb = jnp.zeros((B, T, D))
    with pytest.raises(ValueError, match="mode='none' takes no site"):
        ResidualStream(AttnResConfig(mode="none"), emb).sublayer_input(lambda s: s[0])
    with pytest.raises(ValueError, match="needs an AttnResSite"):
        ResidualStream(AttnResConfig(mode="block"), emb).sublayer_input(None)
    with pytest.raises(ValueError, match="needs an AttnResSite"):
        ResidualStream(AttnResConfig(mode="full"), emb).final(None)
