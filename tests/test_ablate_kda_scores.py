"""experiments/ablate_kda_scores: each ablation changes the kernels it names while it is active, and only then."""

import jax
import numpy as np
import pytest

from experiments import ablate_kda_scores, bench_kda
from pallas_kernels.kda import pallas_chunk, pallas_fwd
from pallas_kernels.kda.pallas_fwd import Tuning


def _forward(x):
    jax.clear_caches()
    return np.asarray(bench_kda._jax_fns("pallas", True, Tuning())[0](*x), np.float32)  # interpret mode on the CPU


@pytest.mark.parametrize("name", ["no_solve", *(pytest.param(n, marks=pytest.mark.slow)
                                                for n in ("no_products", "no_gate_sums", "no_exp"))])
def test_an_ablation_changes_the_forward_and_is_undone(name):
    x, _ = bench_kda.random_inputs(0, 1, 128, 1, 64, True)
    before = {attr: getattr(pallas_fwd, attr) for attr in ("_solve", "_write_gated", "partial_scores")}
    before_chunk = {attr: getattr(pallas_chunk, attr) for attr in ("cumsum_rows", "row", "jnp")}
    base = _forward(x)
    with ablate_kda_scores.patched(name):
        ablated = _forward(x)
    assert {attr: getattr(pallas_fwd, attr) for attr in before} == before
    assert {attr: getattr(pallas_chunk, attr) for attr in before_chunk} == before_chunk
    np.testing.assert_array_equal(base, _forward(x))  # undone: the unchanged kernels again
    assert np.abs(ablated - base).max() > 1e-2 * np.abs(base).max()  # the stage left out mattered


def test_unknown_ablations_are_refused():
    with pytest.raises(ValueError, match="ablation must be one of"):
        with ablate_kda_scores.patched("no_such_stage"):
            pass


def test_ablation_lists_split_at_semicolons_when_a_tuning_has_several_fields():
    assert ablate_kda_scores.variants("base,no_solve") == ["base", "no_solve"]
    assert ablate_kda_scores.variants("base; t:cumulative_gates=1,fused_outputs=1") == [
        "base", "t:cumulative_gates=1,fused_outputs=1"]
