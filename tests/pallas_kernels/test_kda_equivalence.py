"""chunk_kda "xla" against the token-by-token "reference": outputs, final states and gradients in fp32.

Compiling dominates the run time, so cases share shapes where they can: lengths up to 64 all pad to one chunk.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, kda_diagonal_path, relative_rms_error
from pallas_kernels.kda.testing import random_inputs

TOL = 1e-5
G_MIN = {"bounded": -5.0, "softplus": None}  # softplus is unbounded: the pairwise diagonal path
ARGS = ("q", "k", "v", "g", "beta", "initial_state")
# A packing for chunk_size 16: resets at chunk boundaries (16, 48), several documents inside chunk 1, a document
# crossing a boundary, ids reused by non-adjacent documents.
PACKED_LENGTHS = (16, 3, 5, 4, 20, 9)
PACKED_IDS = (7, 3, 7, 3, 5, 2)


def _inputs(seq_len, value_heads, gate, seed=0, batch=2, **kw):
    return random_inputs(seed, batch=batch, seq_len=seq_len, heads=2, value_heads=value_heads,
                         key_dim=32, value_dim=32, gate=gate, **kw)


def _run(backend, x, with_state, g_min, **kw):
    state = x["initial_state"] if with_state else None
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=state, output_final_state=True,
                     g_min=g_min, backend=backend, **kw)


def _outputs_and_grads(backend, x, g_min, segment_ids=None, chunk_size=64):
    """(o, final state) and the gradients of a fixed random projection of them with respect to all six inputs."""
    rng = np.random.default_rng(0)
    projection = tuple(rng.standard_normal(x[a].shape, np.float32) for a in ("v", "initial_state"))
    return _vjp(x, projection, segment_ids, backend=backend, g_min=g_min, chunk_size=chunk_size)


# One compiled program for the forward and backward pass together: cheaper to compile than eager jax.vjp's two.
@functools.partial(jax.jit, static_argnames=("backend", "g_min", "chunk_size"))
def _vjp(x, projection, segment_ids, *, backend, g_min, chunk_size):
    def run(*args):
        return _run(backend, dict(zip(ARGS, args)), True, g_min, segment_ids=segment_ids, chunk_size=chunk_size)

    outputs, vjp = jax.vjp(run, *(x[a] for a in ARGS))
    return outputs, vjp(projection)


def _assert_close(ref, out, what):
    err = relative_rms_error(ref, out)
    assert err < TOL, f"{what}: relative RMS error {err:.2e}"


def _assert_all_close(ref, out, what):
    (ref_o, ref_s), ref_grads = ref
    (o, s), grads = out
    _assert_close(ref_o, o, f"{what} o")
    _assert_close(ref_s, s, f"{what} final state")
    for name, r, d in zip(ARGS, ref_grads, grads):
        assert np.isfinite(np.asarray(d)).all(), f"{what} d{name} not finite"
        _assert_close(r, d, f"{what} d{name}")


def _packed(gate, seed):
    x = _inputs(sum(PACKED_LENGTHS), 2, gate, seed=seed, batch=1)
    segment_ids = jnp.asarray(np.repeat(PACKED_IDS, PACKED_LENGTHS)[None], jnp.int32)
    return x, segment_ids


# Every length with both gates, with and without an initial state; grouped value heads (HV = 4) up to one chunk and
# one value head per q/k head (HV = 2) over eight chunks. Lengths up to 64 share one compiled program per gate.
CASES = [
    (1, 4, "bounded", True), (1, 4, "softplus", False),
    (15, 4, "bounded", False), (15, 4, "softplus", True),
    (63, 4, "bounded", False), (63, 4, "softplus", True),
    (64, 4, "bounded", True), (64, 4, "softplus", False),
    (500, 2, "bounded", True), (500, 2, "softplus", False),
]


@pytest.mark.parametrize("seq_len,value_heads,gate,with_state", CASES)
def test_forward_matches_reference(seq_len, value_heads, gate, with_state):
    x = _inputs(seq_len, value_heads, gate, seed=seq_len)
    ref_o, ref_s = _run("reference", x, with_state, G_MIN[gate])
    o, s = _run("xla", x, with_state, G_MIN[gate])
    assert o.shape == x["v"].shape and o.dtype == jnp.float32 and s.dtype == jnp.float32
    _assert_close(ref_o, o, "o")
    _assert_close(ref_s, s, "final state")


def test_gradients_match_reference_bounded():
    # Three chunks, the last one partial: gradients cross chunk boundaries through the carried state.
    x = _inputs(150, 4, "bounded")
    _assert_all_close(_outputs_and_grads("reference", x, -5.0), _outputs_and_grads("xla", x, -5.0), "bounded")


def test_gradients_match_reference_unbounded_packed():
    x, segment_ids = _packed("softplus", seed=1)
    kw = dict(segment_ids=segment_ids, chunk_size=16)
    _assert_all_close(_outputs_and_grads("reference", x, None, **kw), _outputs_and_grads("xla", x, None, **kw),
                      "packed, unbounded")


def test_saturated_bounded_gate_is_finite_and_exact():
    # g = g_min everywhere puts the dense diagonal blocks at their largest exponent, (16 - 1) * 5 = 75.
    assert kda_diagonal_path(-5.0, 64) == ("dense", 16)
    x = _inputs(150, 4, "bounded")
    x["g"] = jnp.full(x["g"].shape, -5.0, jnp.float32)
    _assert_all_close(_outputs_and_grads("reference", x, -5.0), _outputs_and_grads("xla", x, -5.0), "saturated")


def test_unbounded_gate_with_huge_decays_is_finite_and_exact():
    x, segment_ids = _packed("softplus", seed=2)
    x["g"] = jnp.asarray(-50.0 * np.random.default_rng(3).random(x["g"].shape, np.float32))
    kw = dict(segment_ids=segment_ids, chunk_size=16)
    ref = _outputs_and_grads("reference", x, None, **kw)
    assert all(np.isfinite(np.asarray(r)).all() for r in jax.tree.leaves(ref))
    _assert_all_close(ref, _outputs_and_grads("xla", x, None, **kw), "g down to -50")


# The tilings the op picks besides dense 16 and the unbounded pairwise path: dense 64 / 32 / 8 (one, two and eight
# sub-chunks per chunk) and pairwise under a bound too tight for dense blocks.
@pytest.mark.parametrize("g_min,path", [
    (-1.0, ("dense", 64)),
    (-2.0, ("dense", 32)),
    (-8.0, ("dense", 8)),
    (-15.0, ("pairwise", 16)),
])
def test_every_tiling_matches_reference(g_min, path):
    assert kda_diagonal_path(g_min, 64) == path
    x = _inputs(500, 2, "bounded", g_min=g_min)
    # Saturate a third of the gates at the bound, the hardest case for dense blocks.
    saturated = np.random.default_rng(4).random(x["g"].shape) < 1 / 3
    x["g"] = jnp.asarray(np.where(saturated, g_min, x["g"]))
    ref_o, ref_s = _run("reference", x, True, g_min)
    o, s = _run("xla", x, True, g_min)
    _assert_close(ref_o, o, "o")
    _assert_close(ref_s, s, "final state")
