"""Index-masked causal flash attention for TPU (Pallas' TPU interpreter) against MLA's XLA reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.layers import attention_splash
from hybridmoe.layers.mla import xla_attention
from pallas_kernels.attention.flash_tpu import block_tables, flash_attention

B, T, H, DQK, DV = 2, 300, 2, 48, 32  # three 128-row tiles, the last one part padding


def _inputs(ids_rows, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, DQK)), dtype) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, DV)), dtype)
    return q, k, v, (None if ids_rows is None else jnp.asarray(ids_rows, jnp.int32))


def _packed():
    ids = np.zeros((B, T), np.int32)
    ids[0, 70:], ids[0, 200:], ids[1, 130:] = 1, 2, 5  # documents across tile edges and inside tiles
    return ids


def _unordered():
    ids = np.zeros((B, T), np.int32)
    ids[0, :100], ids[0, 100:220], ids[0, 220:] = 3, 1, 3  # a document resumed after another: ids not sorted
    ids[1, ::2] = 7
    return ids


@pytest.mark.parametrize("ids", [None, _packed(), _unordered()], ids=["one_document", "packed", "unordered"])
def test_matches_xla_attention_forward_and_gradients(ids):
    q, k, v, ids = _inputs(ids)
    flash = lambda q, k, v: flash_attention(q, k, v, ids, 0.2, tile=128, interpret=True)  # noqa: E731
    xla = lambda q, k, v: xla_attention(q, k, v, ids, 0.2)  # noqa: E731
    np.testing.assert_allclose(flash(q, k, v), xla(q, k, v), rtol=1e-5, atol=1e-5)
    probe = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, H, DV)), jnp.float32)
    grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * probe), argnums=(0, 1, 2))(q, k, v) for f in (flash, xla)]
    for name, got, want in zip("qkv", *grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def test_documents_do_not_see_each_other():
    q, k, v, ids = _inputs(_packed())
    run = lambda k, v: flash_attention(q, k, v, ids, 0.2, tile=128, interpret=True)  # noqa: E731
    out = run(k, v)
    again = run(k.at[0, :70].add(1.0), v.at[0, :70].add(1.0))  # new keys and values in row 0's first document
    np.testing.assert_array_equal(again[0, 70:], out[0, 70:])
    np.testing.assert_array_equal(again[1], out[1])
    assert not np.allclose(again[0, :70], out[0, :70])


def test_bf16_close_to_the_fp32_reference():
    q, k, v, ids = _inputs(_packed(), jnp.bfloat16)
    got = flash_attention(q, k, v, ids, 0.2, tile=128, interpret=True)
    assert got.dtype == jnp.bfloat16
    want = xla_attention(*(x.astype(jnp.float32) for x in (q, k, v)), ids, 0.2)
    rel = jnp.sqrt(jnp.mean((got.astype(jnp.float32) - want) ** 2) / jnp.mean(want ** 2))
    assert float(rel) < 0.01


def test_block_tables_follow_the_documents():
    # four documents of two tiles each: query block i needs key blocks from its document's first tile only
    ids = jnp.repeat(jnp.arange(4), 256)[None]
    first_kv, last_q = block_tables(ids, 128)
    np.testing.assert_array_equal(first_kv, [0, 0, 2, 2, 4, 4, 6, 6])
    np.testing.assert_array_equal(last_q, [1, 1, 3, 3, 5, 5, 7, 7])
    visited = int(jnp.sum(jnp.arange(8) - first_kv + 1))
    assert visited == 12  # of the 36 block pairs a causal-only skip would visit
    # a document boundary inside a tile makes both tiles' blocks meet; one resumed later meets across the gap
    first_kv, last_q = block_tables(jnp.asarray([[0] * 100 + [1] * 156, [2] * 128 + [1] * 128]), 128)
    np.testing.assert_array_equal(first_kv, [0, 0, 0, 1])
    np.testing.assert_array_equal(last_q, [1, 1, 0, 1])


def test_bad_tile_names_the_value():
    q, k, v, ids = _inputs(None)
    with pytest.raises(ValueError, match=r"tile=192 must be a multiple of 128 dividing the padded length 384"):
        flash_attention(q, k, v, ids, 0.2, tile=192, interpret=True)


def test_pallas_backend_hands_long_rows_to_the_flash_kernel(monkeypatch):
    q, k, v, ids = _inputs(_packed())
    calls = []
    monkeypatch.setattr(attention_splash, "flash_attention",
                        lambda *a, **kw: calls.append(a[0].shape[1]) or flash_attention(*a, **kw))
    monkeypatch.setattr(attention_splash, "SPLASH_MAX_LENGTH", T - 1)
    got = attention_splash.tpu_attention(q, k, v, ids, 0.2, interpret=True)
    assert calls == [T]
    np.testing.assert_allclose(got, xla_attention(q, k, v, ids, 0.2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [8192, 1 << 20])
def test_lowers_for_a_tpu_forward_and_backward(length):
    """Pallas' Mosaic TPU lowering of all three kernels (it rejects unsupported ops and illegal tiles) at MLA's
    widths, up to a million tokens; libtpu's own passes run on a TPU only."""
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    s = jax.ShapeDtypeStruct
    args = (s((1, length, 8, 192), jnp.bfloat16), s((1, length, 8, 192), jnp.bfloat16),
            s((1, length, 8, 128), jnp.bfloat16), s((1, length), jnp.int32))
    loss = lambda *a: jnp.sum(flash_attention(*a, 192 ** -0.5).astype(jnp.float32))  # noqa: E731
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3
