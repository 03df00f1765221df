"""The model-level KDA check's verdict (experiments/loss_agreement.py, used by
experiments/compare_kda_backends.py), on made-up loss curves."""

from experiments.loss_agreement import compare, verdict


def _curves(noise, gap, steps=5, pallas_steps=None):
    ref = [3.0 - 0.1 * i for i in range(steps)]
    bf16 = [x + noise for x in ref]
    pallas = [x + gap for x in bf16][:pallas_steps or steps]
    return {"xla/float32": ref, "xla/bfloat16": bf16, "pallas/bfloat16": pallas}


def test_gap_within_noise_passes_and_outside_fails():
    assert verdict([compare(_curves(2e-3, 1e-3), 5)])["within_bf16_noise"]
    assert not verdict([compare(_curves(2e-3, 5e-3), 5)])["within_bf16_noise"]
    # several seeds: the limit is the mean noise plus two standard errors of it
    seeds = [compare(_curves(n, g), 5) for n, g in ((1e-3, 2e-3), (3e-3, 2e-3), (2e-3, 2.5e-3))]
    result = verdict(seeds)
    assert result["noise_stderr"] > 0 and result["within_bf16_noise"]


def test_a_run_stopped_early_is_no_check():
    # a run that logged fewer steps than asked (stopped by a signal) leaves the comparison incomplete: never a pass,
    # even when the steps it did log agree
    seed = compare(_curves(2e-3, 0.0, pallas_steps=1), 5)
    assert not seed["complete"]
    result = verdict([seed])
    assert not result["complete"] and not result["within_bf16_noise"]


def test_small_gaps_are_not_waved_through_by_a_floor():
    # no 1e-3 floor: a gap of 8e-4 against noise of 1e-4 fails
    assert not verdict([compare(_curves(1e-4, 8e-4), 5)])["within_bf16_noise"]
