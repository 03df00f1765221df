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


def _packed():
    x = random_inputs(0, batch=1, seq_len=sum(LENGTHS), heads=2, value_heads=4, key_dim=32, value_dim=32)
    return x, jnp.asarray(np.repeat(IDS, LENGTHS)[None], jnp.int32)


def _run(x, initial_state, **kw):
    return chunk_kda(*(x[n] for n in NAMES), initial_state=initial_state, output_final_state=True, **kw)


def _documents_alone(x, lengths):
    """Each document as its own batch row from t = 0, zero-padded to the longest (zero steps change nothing), with
    the initial state on the first document only."""
    starts = np.cumsum((0,) + lengths[:-1])
    longest = max(lengths)

    def split(a):
        rows = [np.asarray(a[0, s:s + n]) for s, n in zip(starts, lengths)]
        return jnp.asarray(np.stack([np.pad(r, [(0, longest - len(r))] + [(0, 0)] * (r.ndim - 1)) for r in rows]))

    alone = {n: split(x[n]) for n in NAMES}
    state = np.zeros((len(lengths),) + x["initial_state"].shape[1:], np.float32)
    state[0] = x["initial_state"][0]
    return alone, jnp.asarray(state), starts


def test_packed_documents_equal_documents_alone():
    x, segment_ids = _packed()
    kw = dict(g_min=-5.0, chunk_size=CHUNK_SIZE)
    o, state = _run(x, x["initial_state"], segment_ids=segment_ids, backend="xla", **kw)
    alone, alone_state, starts = _documents_alone(x, LENGTHS)
    o_alone, state_alone = _run(alone, alone_state, backend="xla", **kw)
    for i, (s, n) in enumerate(zip(starts, LENGTHS)):
        err = relative_rms_error(o_alone[i, :n], o[0, s:s + n])
        assert err < TOL, f"document {i} (tokens {s}..{s + n - 1}): relative RMS error {err:.2e}"
    assert relative_rms_error(state_alone[-1], state[0]) < TOL
    # The oracle resets its state at the same places.
    ref_o, ref_state = _run(x, x["initial_state"], segment_ids=segment_ids, backend="reference")
    assert relative_rms_error(ref_o, o) < TOL and relative_rms_error(ref_state, state) < TOL


def test_initial_state_reaches_only_the_first_document():
    x, segment_ids = _packed()
    kw = dict(segment_ids=segment_ids, g_min=-5.0, chunk_size=CHUNK_SIZE, backend="xla")
    o, state = _run(x, x["initial_state"], **kw)
    o_zero, state_zero = _run(x, jnp.zeros_like(x["initial_state"]), **kw)
    first = LENGTHS[0]
    assert not np.allclose(o[:, :first], o_zero[:, :first])
    np.testing.assert_array_equal(o[:, first:], o_zero[:, first:])
    np.testing.assert_array_equal(state, state_zero)


@pytest.mark.parametrize("g_min", [-5.0, None])
@pytest.mark.parametrize("tau", [40, 100])  # inside chunk 0 and inside chunk 1 (chunk_size 64), not at a boundary
def test_future_inputs_leave_past_outputs_bitwise_unchanged(g_min, tau):
    gate = "softplus" if g_min is None else "bounded"
    shape = dict(batch=2, seq_len=500, heads=2, value_heads=2, key_dim=32, value_dim=32, gate=gate)
    x, other = random_inputs(0, **shape), random_inputs(1, **shape)
    future = {n: jnp.concatenate([x[n][:, :tau + 1], other[n][:, tau + 1:]], axis=1) for n in NAMES}
    o, _ = _run(x, x["initial_state"], g_min=g_min, backend="xla")
    o_future, _ = _run(future, x["initial_state"], g_min=g_min, backend="xla")
    np.testing.assert_array_equal(o[:, :tau + 1], o_future[:, :tau + 1])
    assert not np.array_equal(o[:, tau + 1:], o_future[:, tau + 1:])
