"""The KDA layer in rematerialised sequence pieces (KDAConfig.seq_chunk) against one pass, on this backend.

    python -m experiments.verify_kda_pieces --seq_len=131072 --seq_chunk=32768 [--out=benchmarks/results/kda_pieces_h200]

small_h200.gin's KDA layer (d = 1024, 8 heads of 128) on random bf16 inputs, the kernel the backend picks
("auto": Pallas on GPU). Reports RMS(one pass - pieces) / RMS(one pass) of the output and of the gradients of
a fixed random projection of it with respect to x and every parameter, without and with packed documents
(one boundary on a piece boundary, one inside a piece), plus each version's compiled temporaries per token.
The noise floor beside each figure: the same one-pass layer in bf16 against it in fp32 (same parameters,
same inputs), since pieces change the order of bf16 roundings, not the math.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.kda.testing import relative_rms_error

flags.DEFINE_multi_string("gin_file", ["configs/small_h200.gin"], "Model config (its KDAConfig is used).")
flags.DEFINE_integer("seq_len", 131072, "Tokens in the row.")
flags.DEFINE_integer("seq_chunk", 32768, "Tokens per piece.")
flags.DEFINE_string("backend", "auto", "KDAConfig.backend for both versions.")
flags.DEFINE_list("documents", ["1", "3"], "Cases: 1 (one document) and/or 3 (packed documents).")
flags.DEFINE_string("out", "", "Write OUT.json and OUT.md when set.")
FLAGS = flags.FLAGS


def compare(cfg, t: int, piece: int, with_docs: bool) -> dict:
    from hybridmoe.layers.common import dtype_of
    from hybridmoe.layers.kda import KDA

    dt = dtype_of(cfg.dtype)
    kda = dataclasses.replace(cfg.kda, backend=FLAGS.backend, seq_chunk=None)
    pdt = dtype_of(cfg.param_dtype)
    one, pieces = (KDA(c, d_model=cfg.d_model, dtype=dt, param_dtype=pdt)
                   for c in (kda, dataclasses.replace(kda, seq_chunk=piece)))
    fp32 = KDA(kda, d_model=cfg.d_model, dtype=jnp.float32, param_dtype=pdt)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, t, cfg.d_model)), dt)
    probe = jnp.asarray(rng.standard_normal((1, t, cfg.d_model)), jnp.float32)
    segments = None
    if with_docs:  # documents start at piece 1's first token and in the middle of piece 2
        ids = np.zeros((1, t), np.int32)
        ids[:, piece:] = 1
        ids[:, min(t - 1, 2 * piece + piece // 2):] = 2
        segments = jnp.asarray(ids)
    params = jax.jit(one.init)(jax.random.PRNGKey(0), x[:, :256])

    def loss(module):
        return lambda p, x: jnp.sum(module.apply(p, x, segments).astype(jnp.float32) * probe) / t

    row = {"T": t, "seq_chunk": piece, "documents": 3 if with_docs else 1, "backend": FLAGS.backend,
           "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    outs, grads = [], []
    for name, module in (("one_pass", one), ("pieces", pieces), ("fp32", fp32)):
        step = jax.jit(jax.value_and_grad(loss(module), argnums=(0, 1))).lower(params, x).compile()
        row[f"{name}_temp_kib_per_token"] = step.memory_analysis().temp_size_in_bytes / t / 1024
        outs.append(jax.jit(module.apply)(params, x, segments))
        grads.append(step(params, x)[1])
        del step
    for key, (a, b) in (("", (0, 1)), ("floor_", (2, 0))):  # pieces vs one pass; bf16 vs fp32
        row[f"{key}o_rel_rms"] = relative_rms_error(outs[a], outs[b])
        row[f"{key}dx_rel_rms"] = relative_rms_error(grads[a][1], grads[b][1])
        flat = [jax.tree_util.tree_leaves_with_path(grads[i][0]) for i in (a, b)]
        rels = {jax.tree_util.keystr(path): relative_rms_error(u, w) for (path, u), (_, w) in zip(*flat)}
        worst = max(rels, key=rels.get)
        row[f"{key}dparam_rel_rms_max"], row[f"{key}dparam_worst"] = rels[worst], worst
    return row


def main(argv):
    del argv
    from hybridmoe import load_config

    cfg = load_config(FLAGS.gin_file, []).model
    rows = []
    for with_docs in (n == "3" for n in FLAGS.documents):
        rows.append(compare(cfg, FLAGS.seq_len, FLAGS.seq_chunk, with_docs))
        print(json.dumps(rows[-1]), flush=True)
    if FLAGS.out:
        with open(FLAGS.out + ".json", "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
        lines = ["RMS(a - b) / RMS(a): pieces vs one pass, and (floor) one pass in bf16 vs fp32.", "",
                 "| T | piece | documents | o | o floor | dx | dx floor | worst param grad | floor | "
                 "temp KiB/token one pass | pieces |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| {r['T']} | {r['seq_chunk']} | {r['documents']} | {r['o_rel_rms']:.2e} | "
                f"{r['floor_o_rel_rms']:.2e} | {r['dx_rel_rms']:.2e} | {r['floor_dx_rel_rms']:.2e} | "
                f"{r['dparam_rel_rms_max']:.2e} ({r['dparam_worst']}) | {r['floor_dparam_rel_rms_max']:.2e} | "
                f"{r['one_pass_temp_kib_per_token']:.1f} | {r['pieces_temp_kib_per_token']:.1f} |")
        with open(FLAGS.out + ".md", "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    app.run(main)
