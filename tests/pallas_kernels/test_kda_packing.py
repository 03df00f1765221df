"""chunk_kda on packed sequences (segment_ids) and causality: no information crosses a document start or flows back
from the future."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, relative_rms_error
from pallas_kernels.kda.testing import random_inputs

TOL = 1e-5
NAMES = ("q", "k", "v", "g", "beta")

# A reset exactly at a chunk boundary (64), five documents starting inside one chunk, a one-token document, a
# document crossing a chunk boundary, ids reused by non-adjacent documents (a reset is a change of id, not a new id).
# The unbounded path on packed sequences is checked against the reference in test_kda_equivalence.
CHUNK_SIZE = 64
LENGTHS = (64, 10, 30, 20, 1, 75)
IDS = (0, 1, 0, 1, 0, 1)


def _packed_and_alone():
    """Row 0: the packed sequence with the initial state. Row 1 + i: document i alone from t = 0, zero-padded to the
    same length (zero steps change nothing), with the initial state for the first document only. One batch, so one
    compiled program serves both."""
    seq_len = sum(LENGTHS)
    x = random_inputs(0, batch=1, seq_len=seq_len, heads=2, value_heads=4, key_dim=32, value_dim=32)
    starts = np.cumsum((0,) + LENGTHS[:-1])

    def with_documents(a):
        rows = [np.asarray(a[0, s:s + n]) for s, n in zip(starts, LENGTHS)]
        padded = [np.pad(r, [(0, seq_len - len(r))] + [(0, 0)] * (r.ndim - 1)) for r in rows]
        return jnp.asarray(np.stack([np.asarray(a[0])] + padded))

    batch = {n: with_documents(x[n]) for n in NAMES}
    state = np.zeros((1 + len(LENGTHS),) + x["initial_state"].shape[1:], np.float32)
    state[0] = state[1] = x["initial_state"][0]
    segment_ids = np.zeros((1 + len(LENGTHS), seq_len), np.int32)
    segment_ids[0] = np.repeat(IDS, LENGTHS)
    return batch, jnp.asarray(state), jnp.asarray(segment_ids), starts


def _run(x, initial_state, **kw):
    return chunk_kda(*(x[n] for n in NAMES), initial_state=initial_state, output_final_state=True, **kw)


def test_packed_documents_equal_documents_alone():
    x, initial_state, segment_ids, starts = _packed_and_alone()
    kw = dict(segment_ids=segment_ids, g_min=-5.0, chunk_size=CHUNK_SIZE)
    o, state = _run(x, initial_state, backend="xla", **kw)
    for i, (s, n) in enumerate(zip(starts, LENGTHS)):
        err = relative_rms_error(o[1 + i, :n], o[0, s:s + n])
        assert err < TOL, f"document {i} (tokens {s}..{s + n - 1}): relative RMS error {err:.2e}"
    assert relative_rms_error(state[-1], state[0]) < TOL
    # The oracle resets its state at the same places.
    ref_o, ref_state = _run(x, initial_state, backend="reference", **kw)
    assert relative_rms_error(ref_o, o) < TOL and relative_rms_error(ref_state, state) < TOL


def test_initial_state_reaches_only_the_first_document():
    x, initial_state, segment_ids, _ = _packed_and_alone()
    kw = dict(segment_ids=segment_ids, g_min=-5.0, chunk_size=CHUNK_SIZE, backend="xla")
    o, state = _run(x, initial_state, **kw)
    o_zero, state_zero = _run(x, jnp.zeros_like(initial_state), **kw)
    first = LENGTHS[0]
    assert not np.allclose(o[0, :first], o_zero[0, :first])
    np.testing.assert_array_equal(o[0, first:], o_zero[0, first:])
    np.testing.assert_array_equal(state[0], state_zero[0])


@pytest.mark.parametrize("g_min", [-5.0, None])
@pytest.mark.parametrize("tau", [40, 100])  # inside chunk 0 and inside chunk 1 (chunk_size 64), not at a boundary
def test_future_inputs_leave_past_outputs_bitwise_unchanged(g_min, tau):
    gate = "softplus" if g_min is None else "bounded"
    shape = dict(batch=2, seq_len=500, heads=2, value_heads=2, key_dim=32, value_dim=32, gate=gate)
    x, other = random_inputs(0, **shape), random_inputs(1, **shape)
    future = {n: jnp.asarray(np.concatenate([x[n][:, :tau + 1], other[n][:, tau + 1:]], axis=1)) for n in NAMES}
    o, _ = _run(x, x["initial_state"], g_min=g_min, backend="xla")
    o_future, _ = _run(future, x["initial_state"], g_min=g_min, backend="xla")
    np.testing.assert_array_equal(o[:, :tau + 1], o_future[:, :tau + 1])
    assert not np.array_equal(o[:, tau + 1:], o_future[:, tau + 1:])
