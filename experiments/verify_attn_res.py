"""Checks the fused AttnRes mix (pallas_kernels.attn_res) on a GPU against the XLA version, then times both per site.

  python -m experiments.verify_attn_res --out=benchmarks/results/attn_res_kernel_h200

Correctness: for each case the reference is the XLA `attn_res_mix` on fp32 copies of the inputs; the fused kernel's
output and its gradients (every source, the pseudo-query and the key scale, for a random cotangent) are compared
with it by relative RMS error. Bars: 1e-5 for fp32 inputs; for bf16 inputs 1e-2 and at most twice the XLA bf16
path's own error plus 1e-3 (both round their output and source gradients to bf16). Outputs are checked finite.

Timing: `--sites` sites per jitted step, each with its own sources (so no site reads what the previous one left in
the 60 MB L2), forward and forward+backward (one vjp per site with a random cotangent); the step is timed with the
device synchronised before each host clock read around batches of 10 back-to-back steps (after a 0.5 s warm-up),
the median over `--repeats` batches with two rotating input sets, divided by the number of sites. Floors at 4.3 TB/s: forward reads S sources and writes one output; forward+backward
adds reading the S sources and the output gradient and writing S source gradients: (3S + 2)·N·d·e bytes.
"""

from __future__ import annotations

import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from hybridmoe.layers.attn_res import attn_res_mix
from pallas_kernels import attn_res as fused_mod

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "Write <out>.json and <out>.md.")
flags.DEFINE_string("impl", "pallas", "Implementation under test: 'pallas' (GPU) or 'interpret' (any backend).")
flags.DEFINE_list("time_sources", ["2", "3", "4", "5", "6"], "Source counts S to time.")
flags.DEFINE_integer("tokens", 8192, "Tokens N = B·T per site in the timings.")
flags.DEFINE_integer("dim", 512, "Feature size d in the timings.")
flags.DEFINE_integer("sites", 8, "Sites per timed step.")
flags.DEFINE_integer("repeats", 30, "Timed steps per variant.")
flags.DEFINE_bool("verify", True, "Run the correctness checks.")
flags.DEFINE_bool("tune", False, "Also time the fused kernel at other rows / warps per tile.")

BANDWIDTH = 4.3e12  # bytes/s, the H200's measured device-to-device copy rate
# (S, B, T, d, dtype): S = 9 is the most sources a 16-layer block model with block size 2 reads; T = 1000 leaves a
# ragged last tile; d = 128 and 1024 bracket the default 2-row tiles at d = 512.
CASES = [(s, 2, 1000, d, dt) for s in (2, 3, 5, 9) for d in (128, 512) for dt in ("float32", "bfloat16")]
CASES += [(4, 1, 4096, 1024, "bfloat16"), (4, 1, 4096, 1024, "float32")]


def _inputs(seed, s, b, t, d, dtype):
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.standard_normal(s))  # sources of different sizes, so the RMS matters
    sources = [jnp.asarray(rng.standard_normal((b, t, d)) * c, dtype) for c in scales]
    query = jnp.asarray(rng.standard_normal(d) / np.sqrt(d) * 4, jnp.float32)
    scale = jnp.asarray(1.0 + 0.5 * rng.standard_normal(d), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((b, t, d)), dtype)
    return sources, query, scale, cot


@functools.partial(jax.jit, static_argnames="impl")
def _value_and_grads(sources, query, scale, cot, *, impl):
    out, vjp = jax.vjp(lambda *a: attn_res_mix(*a, impl=impl), sources, query, scale)
    return out, vjp(cot.astype(out.dtype))


def _rel(ref, out):
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    return float(np.sqrt(np.mean((ref - out) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


def _errors(ref, got):
    out_r, (src_r, q_r, sc_r) = ref
    out_g, (src_g, q_g, sc_g) = got
    return dict(out=_rel(out_r, out_g), dsources=max(_rel(a, b) for a, b in zip(src_r, src_g)),
                dquery=_rel(q_r, q_g), dscale=_rel(sc_r, sc_g))


def verify(impl):
    rows, failures = [], []
    for i, (s, b, t, d, dtype) in enumerate(CASES):
        sources, query, scale, cot = _inputs(i, s, b, t, d, jnp.dtype(dtype))
        ref = _value_and_grads([x.astype(jnp.float32) for x in sources], query, scale,
                               cot.astype(jnp.float32), impl="xla")
        got = jax.device_get(_value_and_grads(sources, query, scale, cot, impl=impl))
        xla = jax.device_get(_value_and_grads(sources, query, scale, cot, impl="xla"))
        err, xla_err = _errors(ref, got), _errors(ref, xla)
        finite = all(bool(np.isfinite(np.asarray(x, np.float32)).all()) for x in jax.tree.leaves(got))
        ok = finite
        for name, e in err.items():
            bar = 1e-5 if dtype == "float32" else min(1e-2, 2 * xla_err[name] + 1e-3)
            ok &= e < bar
        row = dict(S=s, B=b, T=t, d=d, dtype=dtype, finite=finite, ok=bool(ok),
                   **{f"err_{k}": v for k, v in err.items()}, **{f"xla_err_{k}": v for k, v in xla_err.items()})
        rows.append(row)
        print(f"S={s} [{b},{t},{d}] {dtype:8s} " + " ".join(f"{k}={v:.2e}" for k, v in err.items())
              + f"  (xla {max(xla_err.values()):.2e})  {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            failures.append(row)
    return rows, failures


def _step(impl, tuning):
    """A jitted step: one vjp per site, every site with its own sources; returns the outputs and gradients."""
    def mix(sources, q):
        if impl == "xla":
            return attn_res_mix(sources, q, jnp.ones_like(q), impl="xla")
        return fused_mod.mix.attn_res_mix_fused(sources, q, 1e-6, block_rows=tuning.get("rows"),
                                                interpret=impl == "interpret")

    @jax.jit
    def fwd(site_sources, q):
        return [mix(srcs, q) for srcs in site_sources]

    @jax.jit
    def fwdbwd(site_sources, q, cots):
        results = []
        for srcs, cot in zip(site_sources, cots):
            out, vjp = jax.vjp(mix, srcs, q)
            results.append((out, vjp(cot)))
        return results

    return fwd, fwdbwd


def _median_ms(fn, arg_sets, repeats, batch=10, warm_s=0.5):
    """Median ms per call over `repeats` batches of `batch` back-to-back calls (rotating input sets).

    The device is synchronised before each host clock read; within a batch the calls queue without host
    gaps. A warm-up of at least warm_s seconds first lets the clocks rise from idle.
    """
    jax.block_until_ready(fn(*arg_sets[0]))  # compile
    start = time.perf_counter()
    while time.perf_counter() - start < warm_s:
        for args in arg_sets:
            jax.block_until_ready(fn(*args))
    times = []
    for i in range(repeats):
        jax.block_until_ready(arg_sets)
        start = time.perf_counter()
        for j in range(batch):
            out = fn(*arg_sets[(i + j) % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / batch)
    return statistics.median(times), (min(times), max(times))


def _timing_sets(s, n, d, sites, seed):
    sets = []
    for k in range(2):
        rng = jax.random.split(jax.random.key(seed + k), 2 * sites + 1)
        srcs = [[jax.random.normal(jax.random.fold_in(rng[i], j), (1, n, d), jnp.bfloat16) for j in range(s)]
                for i in range(sites)]
        cots = [jax.random.normal(rng[sites + i], (1, n, d), jnp.bfloat16) for i in range(sites)]
        q = jax.random.normal(rng[-1], (d,), jnp.float32) / np.sqrt(d)
        sets.append((srcs, q, cots))
    return sets


def time_sites(impl):
    n, d, sites = FLAGS.tokens, FLAGS.dim, FLAGS.sites
    variants = [("xla", {}), (impl, {})]
    if FLAGS.tune:
        variants += [(impl, dict(rows=r, warps=w)) for r in (1, 2, 4) for w in (4, 8) if (r, w) != (2, 4)]
    rows = []
    for s in map(int, FLAGS.time_sources):
        sets = _timing_sets(s, n, d, sites, seed=100 * s)
        e = 2
        floor_fwd = (s + 1) * n * d * e / BANDWIDTH * 1e6
        floor_all = (3 * s + 2) * n * d * e / BANDWIDTH * 1e6
        for name, tuning in variants:
            saved = fused_mod.mix.FORWARD, fused_mod.mix.BACKWARD
            if "warps" in tuning:
                fused_mod.mix.FORWARD = fused_mod.mix.Tuning(num_warps=tuning["warps"])
                fused_mod.mix.BACKWARD = fused_mod.mix.Tuning(blocks=8, num_warps=tuning["warps"])
            try:
                fwd, fwdbwd = _step(name, tuning)
                f_ms, _ = _median_ms(fwd, [a[:2] for a in sets], FLAGS.repeats)
                fb_ms, spread = _median_ms(fwdbwd, sets, FLAGS.repeats)
            finally:
                fused_mod.mix.FORWARD, fused_mod.mix.BACKWARD = saved
            label = name if not tuning else f"{name} rows={tuning['rows']} warps={tuning['warps']}"
            row = dict(variant=label, S=s, N=n, d=d, dtype="bfloat16", sites=sites,
                       fwd_us=f_ms * 1e3 / sites, fwdbwd_us=fb_ms * 1e3 / sites,
                       fwdbwd_spread_us=[x * 1e3 / sites for x in spread],
                       floor_fwd_us=floor_fwd, floor_fwdbwd_us=floor_all)
            rows.append(row)
            print(f"S={s} {label:24s} fwd {row['fwd_us']:7.1f} us (floor {floor_fwd:5.1f})  "
                  f"fwd+bwd {row['fwdbwd_us']:7.1f} us (floor {floor_all:5.1f})", flush=True)
    return rows


def write(out, checks, timings):
    versions = dict(jax=jax.__version__, device=str(jax.devices()[0].device_kind))
    with open(out + ".json", "w") as f:
        json.dump(dict(versions=versions, checks=checks, timings=timings), f, indent=1)
    lines = [f"# Fused AttnRes mix on {versions['device']} (jax {versions['jax']})", "",
             "`python -m experiments.verify_attn_res` (see its docstring for the method and the bars).", "",
             "## Against the XLA version (fp32 reference), relative RMS error", "",
             "| S | B | T | d | dtype | out | d sources (worst) | d query | d scale | XLA bf16 worst | ok |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in checks:
        xla = max(r[k] for k in r if k.startswith("xla_err_")) if r["dtype"] == "bfloat16" else float("nan")
        lines.append(f"| {r['S']} | {r['B']} | {r['T']} | {r['d']} | {r['dtype']} | {r['err_out']:.1e} | "
                     f"{r['err_dsources']:.1e} | {r['err_dquery']:.1e} | {r['err_dscale']:.1e} | {xla:.1e} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    if timings:
        t = timings[0]
        lines += ["", f"## Per site, bf16, N = {t['N']} tokens, d = {t['d']}, {t['sites']} sites per step, µs", "",
                  "| S | variant | forward | floor | forward+backward | floor | fwd+bwd / floor |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for r in timings:
            lines.append(f"| {r['S']} | {r['variant']} | {r['fwd_us']:.1f} | {r['floor_fwd_us']:.1f} | "
                         f"{r['fwdbwd_us']:.1f} | {r['floor_fwdbwd_us']:.1f} | "
                         f"{r['fwdbwd_us'] / r['floor_fwdbwd_us']:.2f} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv):
    del argv
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    checks, failures = verify(FLAGS.impl) if FLAGS.verify else ([], [])
    timings = time_sites(FLAGS.impl) if FLAGS.repeats > 0 else []
    if FLAGS.out:
        write(FLAGS.out, checks, timings)
    if failures:
        raise SystemExit(f"{len(failures)} of {len(checks)} checks failed")


if __name__ == "__main__":
    app.run(main)
