"""KDAConfig.seq_chunk: the KDA layer over rematerialised sequence pieces equals the one-pass layer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.config import KDAConfig
from hybridmoe.layers.kda import KDA

CFG = KDAConfig(num_heads=2, head_dim=16, chunk_size=16, backend="xla")


def _segments(t):
    # row 0: documents start inside pieces; row 1: one starts exactly on a piece boundary (t = 64)
    ids = np.zeros((2, t), np.int32)
    ids[0, 40:], ids[0, 100:] = 1, 2
    ids[1, 64:] = 3
    return jnp.asarray(ids)


@pytest.mark.parametrize("with_docs, piece", [(False, 32), (True, 64),  # the other two pairs with the slow tests
                                             pytest.param(True, 32, marks=pytest.mark.slow),
                                             pytest.param(False, 64, marks=pytest.mark.slow)])
def test_pieces_match_one_pass(with_docs, piece):
    t = 150  # not a multiple of the piece: the last piece is padded
    x = jax.random.normal(jax.random.PRNGKey(1), (2, t, 32))
    segments = _segments(t) if with_docs else None
    one = KDA(CFG, d_model=32)
    pieces = KDA(dataclasses.replace(CFG, seq_chunk=piece), d_model=32)
    params = one.init(jax.random.PRNGKey(0), x)
    assert jax.tree.structure(pieces.init(jax.random.PRNGKey(0), x)) == jax.tree.structure(params)

    probe = jax.random.normal(jax.random.PRNGKey(2), (2, t, 32))
    loss = lambda module: lambda p, x: jnp.sum(module.apply(p, x, segments) * probe)  # noqa: E731
    np.testing.assert_allclose(pieces.apply(params, x, segments), one.apply(params, x, segments),
                               rtol=1e-5, atol=1e-5)
    want = jax.grad(loss(one), argnums=(0, 1))(params, x)
    got = jax.grad(loss(pieces), argnums=(0, 1))(params, x)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_a_document_start_on_a_piece_boundary_drops_the_state():
    """Row 1's second document starts at t = 64, the first token of piece 1: its outputs must not depend on
    anything before it (no state and no convolution tap crosses into the previous document)."""
    t = 128
    module = KDA(dataclasses.replace(CFG, seq_chunk=64), d_model=32)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, t, 32))
    segments = _segments(t)
    params = module.init(jax.random.PRNGKey(0), x)
    changed = x.at[1, :64].set(jax.random.normal(jax.random.PRNGKey(3), (64, 32)))
    np.testing.assert_array_equal(module.apply(params, changed, segments)[1, 64:],
                                  module.apply(params, x, segments)[1, 64:])


def test_pieces_keep_fewer_temporaries():
    t = 4096
    x = jax.ShapeDtypeStruct((1, t, 64), jnp.float32)
    sizes = []
    for piece in (None, 512):
        module = KDA(dataclasses.replace(CFG, num_heads=4, seq_chunk=piece), d_model=64)
        params = jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros((1, 64, 64)))
        step = jax.jit(jax.grad(lambda p, x: jnp.sum(module.apply(p, x) ** 2), argnums=(0, 1)))
        sizes.append(step.lower(params, x).compile().memory_analysis().temp_size_in_bytes)
    assert sizes[1] < 0.5 * sizes[0], sizes


@pytest.mark.parametrize("bad", [0, -64, 40])
def test_seq_chunk_must_be_whole_chunks(bad):
    with pytest.raises(ValueError, match=r"KDAConfig\.seq_chunk must be .*multiple of chunk_size=16"):
        KDAConfig(chunk_size=16, seq_chunk=bad)
