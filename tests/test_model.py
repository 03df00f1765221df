"""HybridLM: shapes, variable collections, logical axes, causality and packed-sequence isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from hybridmoe import build_model, load_config
from tests.model_utils import init_model, logits_of, packed_pair, small_config


def test_forward_shapes_and_collections():
    cfg = small_config()
    model, variables, tokens = init_model(cfg)
    assert set(variables) == {"params", "router"}
    logits, aux = model.apply(variables, tokens)
    assert logits.shape == (2, 40, cfg.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    moe_layers = sorted(aux["router"])
    assert moe_layers == ["layer_0", "layer_1", "layer_2", "layer_3"]
    assert aux["aux_loss"].shape == ()
    # The router state is not a parameter, so no optimizer ever sees it.
    flat = jax.tree_util.tree_leaves_with_path(variables["params"])
    assert not any("router" in jax.tree_util.keystr(p) and "state" in jax.tree_util.keystr(p)
                   for p, _ in flat)


def test_every_parameter_has_logical_axes():
    cfg = small_config()
    model, variables, _ = init_model(cfg)
    boxed = jax.tree_util.tree_leaves(variables["params"],
                                      is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert boxed and all(isinstance(p, nn.LogicallyPartitioned) for p in boxed)
    for p in boxed:
        assert len(p.names) == p.value.ndim, p.names


def test_router_state_updates_only_when_mutable():
    cfg = small_config()
    model, variables, tokens = init_model(cfg)
    _, updated = model.apply(variables, tokens, mutable=["router"])
    before = jax.tree_util.tree_leaves(variables["router"])
    after = jax.tree_util.tree_leaves(updated["router"])
    assert len(before) == len(after)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("tau", [5, 23])
def test_model_causality_bitwise(tau):
    cfg = small_config()
    model, variables, tokens = init_model(cfg, batch=1, length=40)
    base = logits_of(model, variables, tokens)
    changed = tokens.at[:, tau + 1:].set((tokens[:, tau + 1:] + 7) % cfg.vocab_size)
    other = logits_of(model, variables, changed)
    np.testing.assert_array_equal(np.asarray(base[:, :tau + 1]), np.asarray(other[:, :tau + 1]))
    assert not np.array_equal(np.asarray(base[:, tau + 1:]), np.asarray(other[:, tau + 1:]))


@pytest.mark.parametrize("use_rope", [False, True])
def test_packed_sequence_isolation(use_rope):
    cfg = small_config()
    cfg = cfg.__class__(**{**cfg.__dict__, "mla": cfg.mla.__class__(
        **{**cfg.mla.__dict__, "use_rope": use_rope})})
    model, variables, _ = init_model(cfg)
    a, b, packed, seg = packed_pair(jax.random.key(3), 21, 19, cfg.vocab_size)
    together = logits_of(model, variables, packed, seg)
    alone_a = logits_of(model, variables, a)
    alone_b = logits_of(model, variables, b)
    np.testing.assert_allclose(together[:, :21], alone_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(together[:, 21:], alone_b, rtol=1e-5, atol=1e-5)


def test_tiny_config_builds_and_counts_parameters():
    cfg = load_config(["configs/tiny.gin"]).model
    model = build_model(cfg)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 64), jnp.int32))
    count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes["params"]))
    assert 1_000_000 < count < 50_000_000
