"""The whole model trained a few steps with each KDA backend: do the losses agree within bf16 noise?

    python -m experiments.compare_kda_backends --steps=20 --out=benchmarks/results/kda_model_check_h200

Runs the real training loop (`hybridmoe.train.loop.train`, embedded data, same seed and batches) three
times on one config (`configs/tiny.gin` with 64-token KDA chunks and a larger batch):
  * `xla/float32`  — the chunked XLA KDA in fp32: the reference run;
  * `xla/bfloat16` — the same in bf16: its distance from the reference is the bf16 noise;
  * `pallas/bfloat16` — the Pallas kernels in bf16 (the GPU default of `backend="auto"`).
The check: the Pallas run's loss curve is as close to the XLA bf16 run as bf16 is to fp32
(max over steps of |loss difference|), and every loss is finite.
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
flags.DEFINE_string("out", "", "Write OUT.json and OUT.md when set.")
FLAGS = flags.FLAGS

RUNS = (("xla", "float32"), ("xla", "bfloat16"), ("pallas", "bfloat16"))


def train_losses(backend: str, dtype: str, workdir: str) -> list[float]:
    bindings = [f'KDAConfig.backend = "{backend}"', f'ModelConfig.dtype = "{dtype}"',
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
    root = tempfile.mkdtemp(prefix="kda_backends_")
    losses = {}
    try:
        for backend, dtype in RUNS:
            losses[f"{backend}/{dtype}"] = train_losses(backend, dtype, os.path.join(root, backend + dtype))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lengths = {name: len(v) for name, v in losses.items()}
    n = min(lengths.values())
    if n == 0 or len(set(lengths.values())) > 1:
        print(f"warning: runs logged different numbers of training steps: {lengths}; comparing the first {n}")
    ref, bf16, pallas = (np.asarray(losses[f"{b}/{d}"][:n]) for b, d in RUNS)
    noise = float(np.max(np.abs(bf16 - ref)))
    gap = float(np.max(np.abs(pallas - bf16)))
    summary = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "steps": FLAGS.steps,
               "batch_size": FLAGS.batch_size, "losses": losses, "logged_steps": lengths,
               "max_abs_diff_xla_bf16_vs_fp32": noise, "max_abs_diff_pallas_vs_xla_bf16": gap,
               "max_abs_diff_pallas_vs_xla_fp32": float(np.max(np.abs(pallas - ref))),
               "all_finite": bool(all(np.isfinite(v).all() for v in losses.values())),
               "within_bf16_noise": bool(gap <= max(noise, 1e-3))}
    lines = [f"# Whole-model training losses by KDA backend ({summary['device']}, jax {summary['jax']})", "",
             f"`python -m experiments.compare_kda_backends --steps={FLAGS.steps}`: configs/tiny.gin, "
             f"{FLAGS.batch_size} rows x 512 tokens per step, 64-token KDA chunks, same seed and batches.", "",
             "| step | " + " | ".join(losses) + " |", "|---|" + "---|" * len(losses)]
    for i in range(n):
        lines.append(f"| {i + 1} | " + " | ".join(f"{v[i]:.5f}" for v in losses.values()) + " |")
    lines += ["", f"max |xla bf16 - xla fp32| = {noise:.2e} (bf16 noise); "
              f"max |pallas bf16 - xla bf16| = {gap:.2e}; within bf16 noise: {summary['within_bf16_noise']}"]
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
