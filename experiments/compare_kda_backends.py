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
from absl import app, flags

from experiments.loss_agreement import compare, verdict
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
