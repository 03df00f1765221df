"""MLA's TPU path: Pallas splash attention (in Pallas' TPU interpreter) against the XLA reference; the layer also
with the index-masked flash kernel (its own tests: tests/pallas_kernels/test_flash_tpu.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.config import MLAConfig
from hybridmoe.layers.attention_splash import splash_attention
from hybridmoe.layers.mla import MLA, xla_attention

B, T, H, DQK, DV = 2, 200, 2, 48, 32  # T not a multiple of the 128-row tile: padded


def _inputs(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, DQK)), dtype) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, DV)), dtype)
    ids = np.zeros((B, T), np.int32)
    ids[0, 70:], ids[1, 130:] = 1, 5  # row 0's second document starts mid-tile, row 1's on no tile edge
    return q, k, v, jnp.asarray(ids)


@pytest.mark.parametrize("packed", [False, True])
def test_matches_xla_attention_forward_and_gradients(packed):
    q, k, v, ids = _inputs()
    ids = ids if packed else None
    splash = lambda q, k, v: splash_attention(q, k, v, ids, 0.2, interpret=True)  # noqa: E731
    xla = lambda q, k, v: xla_attention(q, k, v, ids, 0.2)  # noqa: E731
    np.testing.assert_allclose(splash(q, k, v), xla(q, k, v), rtol=1e-5, atol=1e-5)
    probe = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, H, DV)), jnp.float32)
    grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * probe), argnums=(0, 1, 2))(q, k, v) for f in (splash, xla)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_documents_do_not_see_each_other():
    q, k, v, ids = _inputs()
    out = splash_attention(q, k, v, ids, 0.2, interpret=True)
    # new keys and values in row 0's first document leave its second document's outputs bitwise equal
    k2, v2 = k.at[0, :70].add(1.0), v.at[0, :70].add(1.0)
    again = splash_attention(q, k2, v2, ids, 0.2, interpret=True)
    np.testing.assert_array_equal(again[0, 70:], out[0, 70:])
    assert not np.allclose(again[0, :70], out[0, :70])


def test_bf16_close_to_the_fp32_reference():
    q, k, v, ids = _inputs(jnp.bfloat16)
    got = splash_attention(q, k, v, ids, 0.2, interpret=True).astype(jnp.float32)
    want = xla_attention(*(x.astype(jnp.float32) for x in (q, k, v)), ids, 0.2)
    assert float(jnp.sqrt(jnp.mean((got - want) ** 2))) < 0.01


@pytest.mark.parametrize("backend", ["pallas_interpret", "pallas_flash_interpret"])
def test_mla_layer_on_the_pallas_interpreter_matches_xla(backend):
    # splash (the "pallas" backend at this length) and the index-masked flash kernel, in the MLA layer
    cfg = MLAConfig(num_heads=2, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((B, 136, 24)), jnp.float32)
    ids = jnp.asarray(np.repeat([[0] * 50 + [1] * 86], B, axis=0))
    xla = MLA(cfg, 24)
    variables = xla.init(jax.random.PRNGKey(0), x[:, :8])
    tpu = MLA(dataclasses.replace(cfg, backend=backend), 24)
    np.testing.assert_allclose(tpu.apply(variables, x, segment_ids=ids), xla.apply(variables, x, segment_ids=ids),
                               rtol=1e-5, atol=1e-5)
