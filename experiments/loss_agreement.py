"""Whether a run's loss curve agrees with a reference within bf16 noise: the verdict of
experiments/compare_kda_backends.py, kept free of absl flags so that tests can import it."""

import numpy as np


def compare(losses: dict[str, list[float]], steps: int) -> dict:
    """One seed's three curves -> the noise (xla bf16 vs fp32) and the Pallas gaps (max over steps). complete: every
    run logged all `steps` (a run stopped early, e.g. by a signal, makes the seed's comparison incomplete)."""
    lengths = {name: len(v) for name, v in losses.items()}
    n = min(lengths.values())
    if n == 0 or len(set(lengths.values())) > 1:
        print(f"warning: runs logged different numbers of training steps: {lengths}; comparing the first {n}")
    ref, bf16, pallas = (np.asarray(v[:n]) for v in losses.values())
    return {"logged_steps": lengths,
            "max_abs_diff_xla_bf16_vs_fp32": float(np.max(np.abs(bf16 - ref))),
            "max_abs_diff_pallas_vs_xla_bf16": float(np.max(np.abs(pallas - bf16))),
            "max_abs_diff_pallas_vs_xla_fp32": float(np.max(np.abs(pallas - ref))),
            "all_finite": bool(all(np.isfinite(v).all() for v in losses.values())),
            "complete": all(n == steps for n in lengths.values())}


def verdict(per_seed: list[dict]) -> dict:
    """Within bf16 noise: every run complete and finite, and mean Pallas gap <= mean noise + 2 standard errors of the
    noise's mean (with one seed, the gap against that seed's noise). The limit's 1e-6 floor is the losses' own fp32
    rounding, so that two bit-identical bf16 runs do not fail."""
    noise = np.asarray([r["max_abs_diff_xla_bf16_vs_fp32"] for r in per_seed])
    gap = np.asarray([r["max_abs_diff_pallas_vs_xla_bf16"] for r in per_seed])
    stderr = float(np.std(noise, ddof=1) / np.sqrt(len(noise))) if len(noise) > 1 else 0.0
    limit = max(float(noise.mean()) + 2 * stderr, 1e-6)
    ok = all(r["all_finite"] and r.get("complete", True) for r in per_seed)
    return {"mean_noise": float(noise.mean()), "noise_stderr": stderr, "mean_gap": float(gap.mean()),
            "limit": limit, "gap_over_noise": float(gap.mean() / max(noise.mean(), 1e-12)),
            "all_finite": all(r["all_finite"] for r in per_seed),
            "complete": all(r.get("complete", True) for r in per_seed),
            "within_bf16_noise": bool(gap.mean() <= limit and ok)}
