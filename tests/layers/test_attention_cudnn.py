"""The cuDNN path's host-side pieces (the kernel itself runs only on a GPU: experiments/verify_attention.py)."""

import jax.numpy as jnp
import numpy as np

from hybridmoe.layers.attention_cudnn import pad_head_dims, packed_segments
from hybridmoe.layers.mla import xla_attention


def test_packed_segments_follow_the_documented_layout():
    ids = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2],
                     [5, 5, 5, 5, 5, 5, 5, 5]])
    seqlen, offsets, overflow = packed_segments(ids, max_segments=4)
    np.testing.assert_array_equal(seqlen, [[3, 2, 3, -1], [8, -1, -1, -1]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]])
    np.testing.assert_array_equal(overflow, [False, False])


def test_packed_segments_flag_rows_with_too_many_documents():
    ids = jnp.array([[0, 1, 2, 3, 4, 4]])
    seqlen, offsets, overflow = packed_segments(ids, max_segments=3)
    np.testing.assert_array_equal(seqlen, [[1, 1, 1]])
    np.testing.assert_array_equal(offsets, [[0, 1, 2, -1]])
    assert bool(overflow[0])


def test_padding_head_dims_leaves_attention_unchanged():
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(1, 8, 2, 6)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(1, 8, 2, 4)), jnp.float32)
    ids = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2]])
    qp, kp, vp, dv = pad_head_dims(q, k, v)
    assert qp.shape[-1] == kp.shape[-1] == vp.shape[-1] == 6 and dv == 4
    np.testing.assert_allclose(xla_attention(qp, kp, vp, ids, 0.4)[..., :dv], xla_attention(q, k, v, ids, 0.4),
                               rtol=1e-6, atol=1e-6)
