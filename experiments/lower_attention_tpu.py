"""MLA's TPU attention (MLAConfig.backend="pallas" and "pallas_flash"), forward + backward, lowered for Mosaic TPU.

    python -m experiments.lower_attention_tpu [--lengths=8192,65536,262144,1048576] \
        [--out=benchmarks/results/mla_tpu_attention_lowering.md]

"pallas" is splash attention up to SPLASH_MAX_LENGTH tokens and the index-masked flash kernel beyond;
"pallas_flash" is the flash kernel at every length.

small_h200.gin's attention shapes: 8 heads, q/k 192 and v 128 wide, bf16, one packed row with three documents.
Lowered on the host through an abstract TPU mesh (experiments/lower_kda_tpu.lower): this shows the kernels build
for each chip, not that they run or how fast; nothing here is a TPU timing.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments.lower_kda_tpu import lower  # defines --targets (TPU device kinds) and --out
from hybridmoe.layers.attention_splash import SPLASH_MAX_LENGTH, tpu_attention
from pallas_kernels.attention.flash_tpu import default_tile, flash_attention

flags.DEFINE_list("lengths", ["8192", "65536", "262144", "1048576"], "Sequence lengths.")
FLAGS = flags.FLAGS


def _loss(attend):
    def loss(q, k, v, ids):
        return jnp.sum(attend(q, k, v, ids, 192 ** -0.5).astype(jnp.float32))
    return loss


def main(argv):
    del argv
    lines = ["# MLA attention on TPU (`MLAConfig.backend='pallas'`, `'pallas_flash'`): lowering for Mosaic TPU", "",
             f"jax {jax.__version__}; `python -m experiments.lower_attention_tpu`, lowered on "
             f"{jax.devices()[0].platform} for each target (no TPU attached). B = 1, 8 heads, Dqk 192, Dv 128, bf16, "
             "segment ids, forward + backward (`jax.grad` w.r.t. q, k, v). `pallas` is splash attention up to "
             f"{SPLASH_MAX_LENGTH} tokens and the index-masked flash kernel (`pallas_kernels/attention/flash_tpu.py`) "
             "beyond. The flash kernel's only tables are two int32 per 512-row block (16 KiB of scalar memory at "
             "1M). Lowering time includes building splash's mask tables on the host. **Not a TPU run or timing.**",
             "", "| T | backend | kernel | target | result | lowering s |", "|---|---|---|---|---|---:|"]
    for t in map(int, FLAGS.lengths):
        args = (jax.ShapeDtypeStruct((1, t, 8, 192), jnp.bfloat16), jax.ShapeDtypeStruct((1, t, 8, 192), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, t), jnp.int32))
        picked = "splash" if t <= SPLASH_MAX_LENGTH else f"flash, tile {default_tile(t)[1]}"
        for backend, attend, kernel in (("pallas", tpu_attention, picked),
                                        ("pallas_flash", flash_attention, f"flash, tile {default_tile(t)[1]}")):
            for kind in FLAGS.targets:
                start = time.perf_counter()
                result, _ = lower(jax.grad(_loss(attend), argnums=(0, 1, 2)), args, kind)
                lines.append(f"| {t} | {backend} | {kernel} | {kind} | {result} | {time.perf_counter() - start:.1f} |")
                print(lines[-1], flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    app.run(main)
