"""MLA attention backends on the GPU: cuDNN against the XLA reference, packing isolation, timing.

    python -m experiments.verify_attention [--seq_lens=1024,32768] [--out=benchmarks/results/mla_cudnn_h200]

Checks, per sequence length, with packed rows (several documents per row, one boundary placed where a
tile of 128 would straddle it):
  * forward and gradients of `cudnn_attention` against `xla_attention` in fp32 (relative RMS error);
  * isolation: scrambling the tokens of one document leaves every other document's outputs
    bitwise unchanged (a path that ignored segment ids would fail this);
  * a row with more documents than `max_segments` comes back NaN, never silently merged.
Then times the forward and forward+backward (event-timed medians via block_until_ready) with and
without segments, and reports TFLOP/s for the causal FLOPs.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from hybridmoe.layers.attention_cudnn import cudnn_attention
from hybridmoe.layers.mla import xla_attention

flags.DEFINE_list("seq_lens", ["1024", "8192"], "Lengths verified against XLA (T^2 memory).")
flags.DEFINE_list("time_lens", ["8192", "32768", "131072"], "Lengths timed (cuDNN only).")
flags.DEFINE_integer("heads", 16, "Attention heads.")
flags.DEFINE_integer("dqk", 192, "Query/key head dim (MLA: nope 128 + rope 64).")
flags.DEFINE_integer("dv", 128, "Value head dim.")
flags.DEFINE_integer("repeats", 10, "Timed repeats.")
flags.DEFINE_string("out", "", "Write OUT.json and OUT.md when set.")
FLAGS = flags.FLAGS


def _segments(b: int, t: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of 3-6 documents; row 0 has a boundary at t//2 + 64 (mid-tile)."""
    ids = np.zeros((b, t), np.int32)
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(16, t - 16), size=rng.integers(2, 6), replace=False))
        if r == 0:
            cuts = np.unique(np.append(cuts, t // 2 + 64))
        ids[r] = np.searchsorted(cuts, np.arange(t), side="right")
    return ids


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def verify(t: int, rng: np.random.Generator) -> dict:
    b, h, scale = 2, FLAGS.heads, FLAGS.dqk ** -0.5
    q, k = (jnp.asarray(rng.standard_normal((b, t, h, FLAGS.dqk)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, h, FLAGS.dv)), jnp.bfloat16)
    seg = jnp.asarray(_segments(b, t, rng))
    cot = jnp.asarray(rng.standard_normal((b, t, h, FLAGS.dv)), jnp.float32)

    def loss(fn, *qkv):
        return jnp.sum(fn(*qkv, seg, scale).astype(jnp.float32) * cot)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_o = jax.jit(lambda *a: xla_attention(*a, seg, scale))(*f32)
    ref_g = jax.jit(jax.grad(lambda *a: loss(xla_attention, *a), argnums=(0, 1, 2)))(*f32)
    out = jax.jit(lambda *a: cudnn_attention(*a, seg, scale))(q, k, v)
    grads = jax.jit(jax.grad(lambda *a: loss(cudnn_attention, *a), argnums=(0, 1, 2)))(q, k, v)
    row = {"T": t, "o_err": _rel(out, ref_o)}
    row.update({f"d{n}_err": _rel(g, r) for n, g, r in zip("qkv", grads, ref_g)})

    # Isolation: scramble document 1 of row 0; all other tokens' outputs must not move at all.
    doc = np.asarray(seg[0] == 1)
    noise = jnp.asarray(rng.standard_normal((t, h, FLAGS.dqk)), jnp.bfloat16)
    q2 = q.at[0].set(jnp.where(doc[:, None, None], noise, q[0]))
    k2 = k.at[0].set(jnp.where(doc[:, None, None], noise[..., ::-1], k[0]))
    out2 = jax.jit(lambda *a: cudnn_attention(*a, seg, scale))(q2, k2, v)
    keep = np.ones((b, t), bool)
    keep[0] &= ~doc
    row["isolation_max_abs_diff"] = float(jnp.max(jnp.abs(
        (out2 - out).astype(jnp.float32))[keep]))
    row["scrambled_doc_changed"] = bool(jnp.any(out2[0][doc] != out[0][doc]))

    many = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // 4, (b, t))  # t/4 documents per row
    over = cudnn_attention(q, k, v, many, scale, max_segments=8)
    row["overflow_is_nan"] = bool(jnp.all(jnp.isnan(over.astype(jnp.float32))))
    return row


def _median_ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_one(t: int, packed: bool, rng: np.random.Generator) -> dict:
    b, h, scale = 1, FLAGS.heads, FLAGS.dqk ** -0.5
    q, k = (jnp.asarray(rng.standard_normal((b, t, h, FLAGS.dqk)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, h, FLAGS.dv)), jnp.bfloat16)
    seg = jnp.asarray(_segments(b, t, rng)) if packed else None
    fwd = jax.jit(lambda q, k, v: cudnn_attention(q, k, v, seg, scale))
    fwdbwd = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        cudnn_attention(q, k, v, seg, scale).astype(jnp.float32)), argnums=(0, 1, 2)))
    # Causal FLOPs of the full row (packing only removes work, so this is an upper bound on it).
    flops = 2 * b * h * t * t * (FLAGS.dqk + FLAGS.dv) / 2
    f_ms, fb_ms = _median_ms(fwd, q, k, v), _median_ms(fwdbwd, q, k, v)
    return {"T": t, "packed": packed, "fwd_ms": f_ms, "fwdbwd_ms": fb_ms,
            "fwd_tflops": flops / f_ms / 1e9, "fwdbwd_tflops": 3.5 * flops / fb_ms / 1e9}


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    checks = []
    for t in map(int, FLAGS.seq_lens):
        checks.append(verify(t, rng))
        print(json.dumps(checks[-1]), flush=True)
    timings = []
    for t in map(int, FLAGS.time_lens):
        for packed in (False, True):
            timings.append(time_one(t, packed, rng))
            print(json.dumps(timings[-1]), flush=True)
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        meta = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                "heads": FLAGS.heads, "dqk": FLAGS.dqk, "dv": FLAGS.dv, "dtype": "bfloat16"}
        result = {"meta": meta, "checks": checks, "timings": timings}
        with open(FLAGS.out + ".json", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        write_markdown(result, FLAGS.out + ".md")


def write_markdown(result: dict, path: str) -> None:
    """The checks and timings of one run (verify_attention's JSON) as markdown tables."""
    m = result["meta"]
    lines = [f"# MLA attention, cuDNN against XLA ({m['device']}, jax {m['jax']})", "",
             f"{m['heads']} heads, dqk {m['dqk']}, dv {m['dv']}, {m['dtype']} inputs. Errors: relative RMS "
             "against `xla_attention` in fp32 on packed rows (several documents per row). Isolation: the "
             "largest change of any other token's output when one document's q/k are scrambled (0 = "
             "bitwise unchanged). Overflow: a row with more documents than `max_segments` is all NaN.", "",
             "| T | o err | dq err | dk err | dv err | isolation max abs diff | scrambled doc changed | "
             "overflow is NaN |", "|---|---|---|---|---|---|---|---|"]
    for c in result["checks"]:
        lines.append(f"| {c['T']} | {c['o_err']:.4f} | {c['dq_err']:.4f} | {c['dk_err']:.4f} | "
                     f"{c['dv_err']:.4f} | {c['isolation_max_abs_diff']:g} | {c['scrambled_doc_changed']} | "
                     f"{c['overflow_is_nan']} |")
    lines += ["", "Timings: one row, medians of `block_until_ready` wall times after a warm-up. TFLOP/s count "
              "the causal FLOPs of the whole row (backward = 2.5x forward); packed rows do less work than "
              "that, so their figures are not hardware rates and may exceed the peak.", "",
              "| T | packed | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |", "|---|---|---|---|---|---|"]
    for r in result["timings"]:
        lines.append(f"| {r['T']} | {r['packed']} | {r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | "
                     f"{r['fwd_tflops']:.0f} | {r['fwdbwd_tflops']:.0f} |")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    app.run(main)
