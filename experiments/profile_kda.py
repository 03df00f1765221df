"""Per-kernel times of the Pallas KDA backend, for several launch tunings, on one shape.

  python -m experiments.profile_kda --shape=1x32768x16x128 --tunings="base;scan_low_precision=1" \
      --out=benchmarks/results/kda_profile_h200

Each kernel group of the forward and backward (see pallas_kernels/kda/pallas_op.py) is jitted alone on inputs made
by the previous group, warmed up, then timed: median of `--repeats` calls, each synchronised before the host clock is
read. The whole forward and forward+backward of the same tuning are timed too, so the parts can be checked against
the sum. A tuning is `base` or `;`-free `field=value` pairs of pallas_fwd.Tuning joined by `,`; tunings are
separated by `;`. Writes OUT.json (rows) and OUT.md (a table per gate).
"""

import dataclasses
import json
import statistics
import time

import numpy as np
from absl import app, flags

# bench_kda also defines --repeats (timed calls, median reported) and --tunings (';'-separated; empty: base)
from experiments.bench_kda import G_MIN, numpy_inputs

FLAGS = flags.FLAGS
STAGES = ("intra_fwd", "state_fwd", "state_bwd", "state_side_bwd", "score_bwd", "input_bwd", "fwd_total",
          "fwdbwd_total")
flags.DEFINE_string("shape", "1x32768x16x128", "BxTxHxD (K = V = D, HV = H).")
flags.DEFINE_list("gates", ["bounded", "unbounded"], "bounded (g_min = -5) and/or unbounded.")
flags.DEFINE_string("out", "", "Output prefix (OUT.json, OUT.md); empty: print only.")
flags.DEFINE_list("stages", list(STAGES), "Which kernel groups (and totals) to time.")
flags.DEFINE_bool("interpret", False, "Interpret the kernels (a CPU smoke run of this script; times mean nothing).")


def parse_tuning(text):
    """'base' or 'state_tile=16,scan_low_precision=1' -> pallas_fwd.Tuning (see Tuning.from_string)."""
    from pallas_kernels.kda.pallas_fwd import Tuning
    return Tuning.from_string(text)


def median_ms(fn, args, repeats):
    import jax
    jax.block_until_ready(fn(*args))  # compile + first run
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def profile(shape, bounded, tuning, repeats):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.kda import api
    from pallas_kernels.kda.pallas_bwd import input_grads, score_grads, state_grad, state_side_grads
    from pallas_kernels.kda.pallas_fwd import intra_forward
    from pallas_kernels.kda.pallas_scan import state_scan
    from pallas_kernels.kda.pallas_op import kda_pallas, pallas_dense

    batch, seq_len, heads, dim = shape
    chunk = 64
    x = numpy_inputs(0, batch, seq_len, heads, dim, bounded)
    bf = jnp.bfloat16
    q, k, v, beta = (jnp.asarray(x[n], bf) for n in ("q", "k", "v", "beta"))
    g = jnp.asarray(x["g"])
    do_full = jnp.asarray(np.random.default_rng(1).standard_normal(x["v"].shape, np.float32), bf)
    chunked = lambda a: a.reshape(batch * seq_len // chunk, chunk, *a.shape[2:])  # noqa: E731
    cq, ck, cv, cg, cb, cdo = map(chunked, (q, k, v, g, beta, do_full))
    doc = jnp.zeros((batch * seq_len // chunk, chunk), jnp.int32)
    s0 = jnp.zeros((batch, heads, dim, dim), jnp.float32)
    diagonal = api.kda_diagonal_path(G_MIN if bounded else None, chunk)
    dense = pallas_dense(diagonal)
    kw = dict(tuning=tuning, interpret=FLAGS.interpret, precision=None)
    scale = dim ** -0.5

    intra = jax.jit(lambda *a: intra_forward(*a, scale=scale, dense=dense, store_dtype=bf, save_scores=True, **kw))
    scan = jax.jit(lambda *a: state_scan(*a, out_dtype=bf, save_states=True, **kw))
    sgrad = jax.jit(lambda *a: state_grad(*a, **kw))
    side = jax.jit(lambda *a: state_side_grads(*a, **kw))
    sgrads = jax.jit(lambda *a: score_grads(*a, **kw))
    igrads = jax.jit(lambda *a: input_grads(*a, scale=scale, dense=dense, **kw))

    times = {}
    wanted = set(FLAGS.stages)

    def timed(name, fn, args, needed=True):
        """Runs fn (its outputs feed the next group) and times it if asked for."""
        if name in wanted:
            times[name] = median_ms(fn, args, repeats)
        return fn(*args) if needed else None

    # the per-chunk forward does not depend on the scans' tuning
    intra_key = (bounded, shape, tuning.intra_warps, tuning.intra_tile, tuning.split_intra, tuning.output_warps)
    intra_args = (cq, ck, cv, cg, cb, doc, doc)
    if intra_key not in _INTRA_OUTPUTS or "intra_fwd" in wanted:
        _INTRA_OUTPUTS.clear()
        _INTRA_OUTPUTS[intra_key] = timed("intra_fwd", intra, intra_args)
    w, qp, kd, u, ol, d, aqk, akk, t = _INTRA_OUTPUTS[intra_key]
    _, _, states, v_new = timed("state_fwd", scan, (w, qp, kd, u, ol, d, s0))
    later = bool(wanted & {"state_side_bwd", "score_bwd", "input_bwd"})
    back = timed("state_bwd", sgrad, (w, qp, kd, d, cdo, jnp.zeros_like(s0)), needed=later)
    if later:
        ds_chunk, dv_new, _ = back
        dqp, dw, dkd, dd = timed("state_side_bwd", side, (states, ds_chunk, v_new, cdo, dv_new))
        daqk, dakk, dkb, _, _ = timed("score_bwd", sgrads, (ck, cv, cg, cb, doc, doc, (aqk, akk, t, w, u), cdo, dv_new,
                                                           dqp, dw))
        timed("input_bwd", igrads, (cq, ck, cg, cb, doc, doc, daqk, dakk, dkb, dqp, dkd, dd), needed=False)

    def forward(q, k, v, g, beta):
        run = api._whole_chunks(lambda *a, **kw: kda_pallas(*a, **kw, tuning=tuning, interpret=FLAGS.interpret))
        return run(q, k, v, g, beta, s0, None, scale=scale, chunk_size=chunk, diagonal=diagonal)

    def grads(q, k, v, g, beta, do):
        (o, _), vjp = jax.vjp(forward, q, k, v, g, beta)
        return o, vjp((do, jnp.zeros_like(s0)))  # o too: the forward's output kernel is part of a training step

    full = (q, k, v, g, beta)
    if "fwd_total" in wanted:
        times["fwd_total"] = median_ms(jax.jit(lambda *a: forward(*a)[0]), full, repeats)
    if "fwdbwd_total" in wanted:
        times["fwdbwd_total"] = median_ms(jax.jit(grads), (*full, do_full), repeats)
    return times


_INTRA_OUTPUTS = {}


def markdown(rows, shape_text):
    lines = [f"# Pallas KDA per-kernel times, {shape_text} (ms, medians)", ""]
    for gate in dict.fromkeys(r["gate"] for r in rows):
        lines += [f"## {gate}", "", "| tuning | " + " | ".join(STAGES) + " |",
                  "|---|" + "---|" * len(STAGES)]
        for r in rows:
            if r["gate"] == gate:
                lines.append(f"| {r['tuning']} | " + " | ".join(f"{r[s]:.3f}" if s in r else "-" for s in STAGES)
                             + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv):
    del argv
    import jax
    shape = tuple(int(s) for s in FLAGS.shape.split("x"))
    rows = []
    for text in (FLAGS.tunings or "base").split(";"):
        tuning = parse_tuning(text)
        for gate in FLAGS.gates:
            start = time.perf_counter()
            try:
                times = profile(shape, gate == "bounded", tuning, FLAGS.repeats)
            except Exception as err:  # keep the other tunings' rows; say what failed
                print(f"{gate} {text}: failed: {type(err).__name__}: {str(err)[:400]}", flush=True)
                continue
            row = dict(gate=gate, tuning=text, shape=FLAGS.shape, **times)
            rows.append(row)
            print(f"{gate:9s} {text:40s} " + " ".join(f"{s}={times[s]:.3f}" for s in STAGES if s in times)
                  + f"  ({time.perf_counter() - start:.0f} s)", flush=True)
            if FLAGS.out:  # after every row, so a cut-off run keeps what it measured
                with open(FLAGS.out + ".json", "w") as f:
                    json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=rows), f, indent=1)
                with open(FLAGS.out + ".md", "w") as f:
                    f.write(markdown(rows, FLAGS.shape) + "\n")
    print(markdown(rows, FLAGS.shape))


if __name__ == "__main__":
    app.run(main)
