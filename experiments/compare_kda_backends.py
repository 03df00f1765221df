"""The whole model trained a few steps with each KDA backend: do the losses agree within bf16 noise?

    python -m experiments.compare_kda_backends --steps=20 --out=benchmarks/results/kda_model_check_h200

Runs the real training loop (`hybridmoe.train.loop.train`, embedded data, same seed and batches) three
times on one config (`configs/tiny.gin` with 64-token KDA chunks and a larger batch):
  * `xla/float32`  — the chunked XLA KDA in fp32: the reference run;
  * `xla/bfloat16` — the same in bf16: its distance from the reference is the bf16 noise;
  * `pallas/bfloat16` — the Pallas kernels in bf16 (the GPU default of `backend="auto"`).
The check, per seed: the Pallas run's loss curve is as close to the XLA bf16 run as bf16 is to fp32 (max over
steps of |loss difference|), and every loss is finite. With several seeds (`--seeds=0,1,2`: model init and data
order), one pair of runs no longer decides it: the verdict compares the mean over seeds of the Pallas gap with the
mean bf16 noise plus two standard errors of that mean (the noise's own spread across seeds).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import numpy as np
from absl import app, flags

from hybridmoe import load_config
from hybridmoe.train.loop import train

flags.DEFINE_multi_string("gin_file", ["configs/tiny.gin"], "Base config.")
flags.DEFINE_integer("steps", 20, "Training steps per run.")
flags.DEFINE_integer("batch_size", 16, "Rows per step.")
flags.DEFINE_list("seeds", ["0"], "Seeds (TrainConfig.seed and DataConfig.seed) to repeat the three runs with.")
flags.DEFINE_string("pallas_backend", "pallas", "KDA backend of the third run ('interpret' for a CPU dry run).")
flags.DEFINE_string("out", "", "Write OUT.json and OUT.md when set.")
FLAGS = flags.FLAGS


def train_losses(backend: str, dtype: str, workdir: str, seed: int = 0) -> list[float]:
    bindings = [f"TrainConfig.seed = {seed}", f"DataConfig.seed = {seed}",
                f'KDAConfig.backend = "{backend}"', f'ModelConfig.dtype = "{dtype}"',
                "KDAConfig.chunk_size = 64", f"TrainConfig.steps = {FLAGS.steps}",
                "TrainConfig.log_every = 1", f"TrainConfig.eval_every = {FLAGS.steps}",
                f"TrainConfig.checkpoint_every = {FLAGS.steps}", "TrainConfig.warmup_steps = 5",
                f"DataConfig.batch_size = {FLAGS.batch_size}"]
    train(load_config(FLAGS.gin_file, bindings), workdir, progress=False)
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r["loss"] for r in records if r["split"] == "train"]


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


def main(argv):
    del argv
    runs = (("xla", "float32"), ("xla", "bfloat16"), (FLAGS.pallas_backend, "bfloat16"))
    seeds = [int(s) for s in FLAGS.seeds]
    root = tempfile.mkdtemp(prefix="kda_backends_")
    curves, per_seed = {}, []
    try:
        for seed in seeds:
            losses = {}
            for backend, dtype in runs:
                print(f"seed {seed}: {backend}/{dtype}", flush=True)
                losses[f"{backend}/{dtype}"] = train_losses(backend, dtype, os.path.join(
                    root, f"{seed}_{backend}{dtype}"), seed)
            curves[seed] = losses
            per_seed.append({"seed": seed, **compare(losses, FLAGS.steps)})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = verdict(per_seed)
    summary = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "steps": FLAGS.steps,
               "batch_size": FLAGS.batch_size, "seeds": seeds, "losses": {str(k): v for k, v in curves.items()},
               "per_seed": per_seed, **result}
    lines = [f"# Whole-model training losses by KDA backend ({summary['device']}, jax {summary['jax']})", "",
             f"`python -m experiments.compare_kda_backends --steps={FLAGS.steps} --seeds={','.join(map(str, seeds))}`: "
             f"configs/tiny.gin, {FLAGS.batch_size} rows x 512 tokens per step, 64-token KDA chunks; the three runs "
             "of a seed share its init and batches.", ""]
    for seed, losses in curves.items():
        n = min(len(v) for v in losses.values())
        lines += [f"Seed {seed}:", "", "| step | " + " | ".join(losses) + " |", "|---|" + "---|" * len(losses)]
        lines += [f"| {i + 1} | " + " | ".join(f"{v[i]:.5f}" for v in losses.values()) + " |" for i in range(n)]
        lines.append("")
    lines += ["| seed | max abs(xla bf16 - xla fp32) (noise) | max abs(pallas bf16 - xla bf16) (gap) | "
              "max abs(pallas bf16 - xla fp32) |", "|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['max_abs_diff_xla_bf16_vs_fp32']:.2e} | {r['max_abs_diff_pallas_vs_xla_bf16']:.2e} "
              f"| {r['max_abs_diff_pallas_vs_xla_fp32']:.2e} |" for r in per_seed]
    lines += ["", f"Mean gap {result['mean_gap']:.2e} against mean noise {result['mean_noise']:.2e} "
              f"(+2 standard errors: limit {result['limit']:.2e}; gap / noise {result['gap_over_noise']:.2f}); "
              f"all finite: {result['all_finite']}; every run complete: {result['complete']}; within bf16 noise: "
              f"{result['within_bf16_noise']}"]
    text = "\n".join(lines) + "\n"
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out + ".json", "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        with open(FLAGS.out + ".md", "w", encoding="utf-8") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    app.run(main)
