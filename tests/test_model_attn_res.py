"""HybridLM in every residual mode (DESIGN §3.4): causality, packed-sequence isolation, gradients.

Each mode compiles one function, (params, tokens [1, 40], segment_ids) -> (logits, grads), and every
check runs through it: a document "alone" is the document followed by filler in a single segment
(by causality the filler cannot reach it), which keeps the shape, and the compile, the same.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe import build_model
from hybridmoe.config import AttnResConfig
from tests.model_utils import packed_pair, small_config

LEN = 20  # each of the two packed documents
TAU = 27  # inside the second document: causality is checked across the boundary too

MODES = {
    "none": AttnResConfig(mode="none"),
    "block1": AttnResConfig(mode="block", block_size=1),
    "block2": AttnResConfig(mode="block", block_size=2),
    "full": AttnResConfig(mode="full"),
}


@functools.lru_cache(maxsize=None)
def _variables():
    """Initialised once, in mode full: blocks use the same sites, mode none none of them."""
    cfg = small_config(attn_res=MODES["full"])
    docs = packed_pair(jax.random.key(3), LEN, LEN, cfg.vocab_size)
    variables = nn.unbox(jax.jit(build_model(cfg).init)(jax.random.key(1), docs[2]))
    # Pseudo-queries moved off zero, so the sites mix non-uniformly and the key norms matter.
    rng = np.random.default_rng(0)
    moved = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.3 * rng.standard_normal(x.shape).astype(x.dtype)
        if "attn_res" in jax.tree_util.keystr(p) else x, variables["params"])
    return variables["router"], {"init": variables["params"], "moved": moved}, docs


def _setup(attn_res: AttnResConfig):
    cfg = small_config(attn_res=attn_res)
    model = build_model(cfg)
    router, params, docs = _variables()
    if attn_res.mode == "none":
        params = {k: _site_params(p, keep=False) for k, p in params.items()}

    @jax.jit
    def logits_and_grads(params, tokens, segment_ids):
        def loss(params):
            logits, aux = model.apply({"params": params, "router": router}, tokens,
                                      segment_ids=segment_ids)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]) + aux["aux_loss"], logits
        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return logits, grads

    return cfg, params, logits_and_grads, docs


@pytest.fixture(scope="module", params=list(MODES))
def setup(request):
    return request.param, _setup(MODES[request.param])


@pytest.mark.parametrize("which", ["init", "moved"])
def test_causality_bitwise(setup, which):
    _, (cfg, params, logits_and_grads, (_, _, packed, seg)) = setup
    base, _ = logits_and_grads(params[which], packed, seg)
    changed = packed.at[:, TAU + 1:].set((packed[:, TAU + 1:] + 7) % cfg.vocab_size)
    other, _ = logits_and_grads(params[which], changed, seg)
    np.testing.assert_array_equal(np.asarray(base[:, :TAU + 1]), np.asarray(other[:, :TAU + 1]))
    assert not np.array_equal(np.asarray(base[:, TAU + 1:]), np.asarray(other[:, TAU + 1:]))


def test_packed_documents_are_isolated(setup):
    """A document packed after another gives the logits it gives alone.

    Not bitwise: the packed shape moves the second document within KDA chunks and MoE expert
    slots, which changes fp32 rounding (by ~2e-6 in mode none already). At initialisation (uniform
    sites) the bar is 1e-5 absolute; with the pseudo-queries moved, rounding differences are
    amplified a little by sharper mixes, so there the bar is DESIGN §5's fp32 metric,
    RMS(ref - out) / RMS(ref) < 1e-5, with a 1e-4 absolute cap. A real leak is orders larger.
    """
    _, (_, params, logits_and_grads, (a, b, packed, seg)) = setup
    one_doc = jnp.ones_like(seg)
    for which, p in params.items():
        together, _ = logits_and_grads(p, packed, seg)
        for doc, got in ((a, together[:, :LEN]), (b, together[:, LEN:])):
            alone, _ = logits_and_grads(p, jnp.concatenate([doc, packed[:, :LEN]], 1), one_doc)
            alone = alone[:, :LEN]
            if which == "init":
                np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5)
            else:
                rel = jnp.sqrt(jnp.mean((got - alone) ** 2) / jnp.mean(alone ** 2))
                assert float(rel) < 1e-5, (which, float(rel))
                np.testing.assert_allclose(got, alone, rtol=0, atol=1e-4)


def _site_params(tree: dict, keep: bool = True) -> dict:
    """The attn_res_* entries of a params tree (keep=False: all the others)."""
    return {k: v for k, v in tree.items() if k.startswith("attn_res_") == keep}


def test_gradients_reach_every_pseudo_query(setup):
    name, (cfg, params, logits_and_grads, (_, _, packed, seg)) = setup
    _, grads = logits_and_grads(params["init"], packed, seg)
    _, grads_moved = logits_and_grads(params["moved"], packed, seg)
    sites = _site_params(grads)
    if name == "none":
        assert not sites
        return
    # A site per sublayer but the first (its one source is the embedding), and the final one.
    want = {f"attn_res_{i}_{s}" for i in range(cfg.num_layers) for s in ("attn", "ffn")}
    assert set(sites) == (want - {"attn_res_0_attn"}) | {"attn_res_final"}
    # At initialisation (zero queries) the key-norm gradients are exactly zero: logits = keys · 0.
    for site, g in sites.items():
        assert float(jnp.max(jnp.abs(g["query"]))) > 0, site
        assert float(jnp.max(jnp.abs(grads_moved[site]["query"]))) > 0, site
        assert float(jnp.max(jnp.abs(grads_moved[site]["key_norm"]))) > 0, site


def test_final_stream_has_no_final_site():
    cfg = small_config(attn_res=AttnResConfig(mode="block", block_size=2, final="stream"))
    shapes = jax.eval_shape(build_model(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    sites = _site_params(shapes["params"])
    assert "attn_res_final" not in sites and "attn_res_3_ffn" in sites
