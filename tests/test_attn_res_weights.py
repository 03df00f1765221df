"""The ablation's weight read-out: per-site mean softmax weights over sources."""

import jax.numpy as jnp
import numpy as np

from hybridmoe.analysis import site_weights
from hybridmoe.config import AttnResConfig
from tests.model_utils import init_model, small_config


def test_site_weights_are_uniform_at_init_and_cover_every_site():
    cfg = small_config(num_layers=2, attn_res=AttnResConfig(mode="block", block_size=1))
    model, variables, tokens = init_model(cfg, batch=1, length=16)
    batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens)}
    weights = site_weights(model, variables, [batch])
    # Layer 0's attention site has one source (no parameters); every other site mixes several.
    assert sorted(weights) == ["attn_res_0_ffn", "attn_res_1_attn", "attn_res_1_ffn", "attn_res_final"]
    for name, w in weights.items():
        np.testing.assert_allclose(w, np.full(len(w), 1.0 / len(w)), rtol=1e-6)  # zero pseudo-queries
    assert len(weights["attn_res_1_ffn"]) == 3  # embedding, block 0, partial of block 1
