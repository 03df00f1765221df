"""The whole-tile chunk algebra of the Pallas KDA kernels (pallas_kernels/kda/pallas_chunk.py), checked directly."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import pallas_chunk as pc


@pytest.mark.parametrize("size", [16, 32, 64, 128])
def test_unit_lower_inverse_matches_dense_inverse(size):
    rng = np.random.default_rng(size)
    l = np.tril(rng.standard_normal((size, size)) * 0.3, -1).astype(np.float32)
    t = np.asarray(pc.unit_lower_inverse(jnp.asarray(l)))
    np.testing.assert_allclose(t, np.linalg.inv(np.eye(size) + l.astype(np.float64)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dense", [True, False])
def test_scores_match_pairwise_definition(dense):
    # Aqk[r, c] = sum_d q k e^(gam_r - gam_c) (c <= r, same document), Akk likewise strictly below the diagonal.
    rng = np.random.default_rng(1)
    size, dim = 64, 16
    q, k = (rng.standard_normal((size, dim)).astype(np.float32) for _ in range(2))
    g = (-5.0 * rng.uniform(size=(size, dim))).astype(np.float32)
    doc = (np.arange(size) >= 40).astype(np.int32)
    x = pc.ChunkIn(q=jnp.asarray(q), k=jnp.asarray(k), v=None, g=jnp.asarray(g), beta=None, doc=jnp.asarray(doc),
                   doc_in=0, doc_last=1)
    aqk, akk = pc.scores(x, pc.decay(x.g), dense=dense)
    gam = np.cumsum(g.astype(np.float64), axis=0)
    decay = np.exp(gam[:, None, :] - gam[None, :, :])
    r, c = np.arange(size)[:, None], np.arange(size)[None, :]
    same = doc[:, None] == doc[None, :]
    want_qk = np.where((r >= c) & same, np.einsum("rd,cd,rcd->rc", q, k, np.where((r >= c)[..., None], decay, 0)), 0)
    want_kk = np.where((r > c) & same, np.einsum("rd,cd,rcd->rc", k, k, np.where((r >= c)[..., None], decay, 0)), 0)
    np.testing.assert_allclose(aqk, want_qk, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(akk, want_kk, rtol=1e-4, atol=1e-4)
