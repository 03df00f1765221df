"""MLA's splash attention (MLAConfig.backend="pallas"), forward + backward, lowered for Mosaic TPU targets.

    python -m experiments.lower_attention_tpu [--lengths=8192,65536] [--out=benchmarks/results/mla_splash_tpu_lowering.md]

small_h200.gin's attention shapes: 8 heads, q/k 192 and v 128 wide, bf16, one packed row with three documents.
Lowered on the host through an abstract TPU mesh (experiments/lower_kda_tpu.lower): this shows the kernels build
for each chip, not that they run or how fast; nothing here is a TPU timing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments.lower_kda_tpu import lower  # defines --targets (TPU device kinds) and --out
from hybridmoe.layers.attention_splash import splash_attention

flags.DEFINE_list("lengths", ["8192", "65536"], "Sequence lengths.")
FLAGS = flags.FLAGS


def _loss(q, k, v, ids):
    return jnp.sum(splash_attention(q, k, v, ids, 192 ** -0.5).astype(jnp.float32))


def main(argv):
    del argv
    lines = ["# MLA splash attention (`MLAConfig.backend='pallas'`): lowering for Mosaic TPU", "",
             f"jax {jax.__version__}; `python -m experiments.lower_attention_tpu`, lowered on "
             f"{jax.devices()[0].platform} for each target (no TPU attached). B = 1, 8 heads, Dqk 192, Dv 128, bf16, "
             "segment ids, forward + backward (`jax.grad` w.r.t. q, k, v). **Not a TPU run or timing.**", "",
             "| T | target | result |", "|---|---|---|"]
    for t in map(int, FLAGS.lengths):
        args = (jax.ShapeDtypeStruct((1, t, 8, 192), jnp.bfloat16), jax.ShapeDtypeStruct((1, t, 8, 192), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, t), jnp.int32))
        for kind in FLAGS.targets:
            result, _ = lower(jax.grad(_loss, argnums=(0, 1, 2)), args, kind)
            lines.append(f"| {t} | {kind} | {result} |")
            print(lines[-1], flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    app.run(main)
