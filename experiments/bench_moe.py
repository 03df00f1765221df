"""Times the routed-expert computation of one MoE layer, forward+backward, by dispatch path (DESIGN §3.3, §5).

  python -m experiments.bench_moe --out_dir=$OUT            # the H200 run
  python -m experiments.bench_moe --small --out_dir=/tmp/x  # CPU smoke test of the harness at a tiny shape

Paths (SwiGLU experts, bf16, tokens·k assignments, random top-k routing):
  capacity          hybridmoe.layers.moe.dispatch_capacity, capacity factor 1.0: sort -> [E, C, d] buffers ->
                    three batched einsums -> gather and combine (overflow dropped, fraction reported)
  dropless_grouped  hybridmoe.layers.moe.dispatch_grouped: sort -> grouped_matmul x3 (Mosaic GPU ragged dot,
                    custom VJP) -> unsort and combine; one row per tile configuration
  dense_matmul      the same SwiGLU on a dense [tokens·k, d] block without routing: same FLOPs, the ceiling

FLOPs counted: forward 3·2·(tokens·k)·d·width, forward+backward 3x that. Time: median over --repeats calls of the
jitted value_and_grad (block_until_ready, wall clock) after --warmup calls, rotating over --input_sets fresh random
input sets. Before timing, grouped_matmul (forward, dx, dw) and dispatch_grouped are checked against fp32 references
on the device at small shapes. Rows go to moe_h200.json in --out_dir as they are measured.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_bool("small", False, "Tiny shapes for a CPU smoke test of the harness.")
flags.DEFINE_string("out_dir", "benchmarks/results", "Where moe_h200.json is written.")
flags.DEFINE_list("experts", ["64", "256"], "Expert counts E.")
flags.DEFINE_integer("tokens", 32768, "Tokens per layer call.")
flags.DEFINE_integer("d_model", 2048, "Model width d.")
flags.DEFINE_integer("width", 1024, "Expert width F.")
flags.DEFINE_integer("top_k", 8, "Experts per token k.")
flags.DEFINE_float("capacity_factor", 1.0, "Capacity factor of the capacity path.")
flags.DEFINE_list("paths", ["dense_matmul", "capacity", "dropless_grouped"], "Paths to time.")
flags.DEFINE_list("grouped_configs", ["table_m192", "unrolled_m192", "table_m128"], "Tile configs (see CONFIGS).")
flags.DEFINE_integer("repeats", 20, "Timed calls per row (median reported).")
flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
flags.DEFINE_integer("input_sets", 3, "Fresh random input sets rotated through the timed calls.")
flags.DEFINE_float("deadline_s", 330.0, "Skip remaining rows once this many seconds have passed.")
flags.DEFINE_bool("check", True, "Check grouped_matmul and dispatch_grouped against fp32 references first.")
flags.DEFINE_list("check_configs", [], "Configs to check (default: every timed one); checks are compile-bound "
                  "(about 100 s for three configs on the H200).")

DENSE_TFLOPS_ANCHOR = 652.0  # bf16 8192^3 matmul on the H200 (shared/anchors/jax_h200_probe.json)
T0 = time.perf_counter()


def _configs():
    from pallas_kernels.moe import GroupedMatmulConfig, TileConfig
    wg = TileConfig(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4)
    return {
        "table_m192": GroupedMatmulConfig(TileConfig(192, 128, 64, 4, 4), wg, "table"),
        "unrolled_m192": GroupedMatmulConfig(TileConfig(192, 128, 64, 4, 4), wg, "unrolled"),
        "table_m128": GroupedMatmulConfig(TileConfig(128, 128, 64, 4, 4), wg, "table"),
        "table_m192_s3": GroupedMatmulConfig(TileConfig(192, 128, 64, 3, 4), wg, "table"),
    }


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_grouped(configs) -> list[dict]:
    """grouped_matmul forward, dx, dw (bf16) against the fp32 dense per-group loop; dispatch_grouped against
    dispatch_dropless (fp32 inputs) at a small shape. Fresh random inputs, empty groups, tail rows."""
    import jax
    import jax.numpy as jnp
    from hybridmoe.layers.moe import ExpertWeights, dispatch_dropless, dispatch_grouped
    from pallas_kernels.moe import grouped_matmul, grouped_matmul_dense_reference

    rng = np.random.default_rng(int(time.time()))
    out = []
    sizes = [0, 301, 1, 0, 257, 190, 64, 0]
    m, k, n = sum(sizes) + 37, 256, 512
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    with jax.default_matmul_precision("highest"):
        ref_y, ref_vjp = jax.vjp(lambda x, w: grouped_matmul_dense_reference(
            x.astype(jnp.float32), w.astype(jnp.float32), sizes), x, w)
        ref_dx, ref_dw = ref_vjp(dy.astype(jnp.float32))
    for name, cfg in configs.items():
        try:
            y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, gs, config=cfg), x, w)
            dx, dw = vjp(dy)
            row = dict(check="grouped_matmul", config=name, y=_rel(y, ref_y), dx=_rel(dx, ref_dx),
                       dw=_rel(dw, ref_dw), tail_zero=bool(np.all(np.asarray(y[sum(sizes):]) == 0)),
                       finite=bool(all(np.isfinite(np.asarray(a, np.float32)).all() for a in (y, dx, dw))))
            row["ok"] = row["finite"] and row["tail_zero"] and max(row["y"], row["dx"], row["dw"]) < 1e-2
        except Exception as e:  # noqa: BLE001 - report and carry on with the other configs
            row = dict(check="grouped_matmul", config=name, ok=False, error=repr(e)[:600])
        print("CHECK", json.dumps(row), flush=True)
        out.append(row)

    # Whole dispatch: bf16 grouped path against the fp32 dropless (capacity C = N) path.
    nt, d, f, e, kk = 512, 256, 256, 8, 4
    xt = rng.standard_normal((nt, d)).astype(np.float32)
    ids = jnp.asarray(np.argsort(rng.random((nt, e)), axis=1)[:, :kk], jnp.int32)
    mask = jnp.asarray(rng.random((nt, kk)) > 0.1)
    comb = jnp.asarray(rng.random((nt, kk)), jnp.float32) * mask
    ws = [rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]) for s in [(e, d, f), (e, d, f), (e, f, d)]]
    r = jnp.asarray(rng.standard_normal((nt, d)), jnp.float32)

    def loss(fn, dtype, **kw):
        def inner(x, w):
            y, _ = fn(x.astype(dtype), ids, comb, mask, ExpertWeights(*(a.astype(dtype) for a in w)),
                      activation="swiglu", capacity=None, **kw)
            return jnp.sum(y.astype(jnp.float32) * r)
        return jax.jit(jax.value_and_grad(inner, (0, 1)))

    args = (jnp.asarray(xt), tuple(jnp.asarray(a) for a in ws))
    with jax.default_matmul_precision("highest"):
        l_ref, (dx_ref, dw_ref) = loss(dispatch_dropless, jnp.float32)(*args)
    for name, cfg in configs.items():
        try:
            l_g, (dx_g, dw_g) = loss(dispatch_grouped, jnp.bfloat16, grouped_config=cfg)(*args)
            row = dict(check="dispatch_grouped", config=name, loss=_rel(l_g, l_ref), dx=_rel(dx_g, dx_ref),
                       dw=max(_rel(a, b) for a, b in zip(dw_g, dw_ref)))
            row["ok"] = max(row["loss"], row["dx"], row["dw"]) < 2e-2
        except Exception as e:  # noqa: BLE001
            row = dict(check="dispatch_grouped", config=name, ok=False, error=repr(e)[:600])
        print("CHECK", json.dumps(row), flush=True)
        out.append(row)
    return out


def make_inputs(seed, tokens, d, e, k, dtype):
    import jax
    import jax.numpy as jnp
    kx, kr, kl = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (tokens, d), dtype)
    logits = jax.random.normal(kl, (tokens, e), jnp.float32)
    top, ids = jax.lax.top_k(logits, k)
    combine = jax.nn.softmax(top, axis=-1)
    mask = jnp.ones((tokens, k), bool)
    r = jax.random.normal(kr, (tokens, d), jnp.float32)
    return x, ids.astype(jnp.int32), combine, mask, r


def make_weights(seed, e, d, f, dtype):
    import jax
    from hybridmoe.layers.moe import ExpertWeights
    ks = jax.random.split(jax.random.key(seed), 3)
    return ExpertWeights(jax.random.normal(ks[0], (e, d, f), dtype) * d ** -0.5,
                         jax.random.normal(ks[1], (e, d, f), dtype) * d ** -0.5,
                         jax.random.normal(ks[2], (e, f, d), dtype) * f ** -0.5)


def time_fn(fn, arg_sets, repeats, warmup):
    import jax
    t = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    compile_s = time.perf_counter() - t
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[(i + 1) % len(arg_sets)]))
    times, last = [], None
    for i in range(repeats):
        args = arg_sets[i % len(arg_sets)]
        t = time.perf_counter()
        last = fn(*args)
        jax.block_until_ready(last)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, compile_s, last, (min(times) * 1e3, max(times) * 1e3)


def main(_):
    import jax
    import jax.numpy as jnp
    from hybridmoe.layers.moe import dispatch_capacity, dispatch_grouped, expert_capacity, glu
    from pallas_kernels.moe import mosaic_supported

    if FLAGS.small:
        FLAGS.tokens, FLAGS.d_model, FLAGS.width, FLAGS.top_k = 256, 128, 128, 2
        FLAGS.experts, FLAGS.repeats, FLAGS.warmup = ["8", "16"], 3, 1
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    out_path = os.path.join(FLAGS.out_dir, "moe_h200.json")
    dev = jax.devices()[0]
    meta = dict(jax=jax.__version__, device=getattr(dev, "device_kind", str(dev)), backend=jax.default_backend(),
                tokens=FLAGS.tokens, d=FLAGS.d_model, width=FLAGS.width, k=FLAGS.top_k, dtype="bfloat16",
                capacity_factor=FLAGS.capacity_factor, repeats=FLAGS.repeats, warmup=FLAGS.warmup,
                input_sets=FLAGS.input_sets, dense_anchor_tflops=DENSE_TFLOPS_ANCHOR)
    print("META", json.dumps(meta), flush=True)
    all_configs = _configs()
    configs = {n: all_configs[n] for n in FLAGS.grouped_configs}
    if jax.default_backend() == "gpu":  # on the GPU the kernels must run: fail loudly, never fall back
        import dataclasses
        configs = {n: dataclasses.replace(c, backend="mosaic_gpu") for n, c in configs.items()}
    result = dict(meta=meta, checks=[], rows=[])

    def save():
        with open(out_path, "w") as fh:
            json.dump(result, fh, indent=1)

    if FLAGS.check and "dropless_grouped" in FLAGS.paths:
        result["checks"] = check_grouped({n: c for n, c in configs.items()
                                          if not FLAGS.check_configs or n in FLAGS.check_configs})
        save()
        # Drop a config on wrong numbers or a failing dispatch; a standalone-shape exception is reported only.
        bad = {c["config"] for c in result["checks"]
               if not c["ok"] and (c["check"] == "dispatch_grouped" or "error" not in c)}
        configs = {n: c for n, c in configs.items() if n not in bad}
        print(f"checks done at {time.perf_counter() - T0:.0f}s; failing configs dropped: {sorted(bad)}", flush=True)

    n, d, f, k, dt = FLAGS.tokens, FLAGS.d_model, FLAGS.width, FLAGS.top_k, jnp.bfloat16
    flops = 3 * 3 * 2 * n * k * d * f
    backend_grouped = ("mosaic_gpu" if jax.default_backend() == "gpu" or (mosaic_supported(dt, d, f)
                                                                        and mosaic_supported(dt, f, d))
                       else "reference")
    meta["auto_backend"] = ("mosaic_gpu" if mosaic_supported(dt, d, f) and mosaic_supported(dt, f, d)
                            else "reference")
    dense_row = None

    def add(row):
        row.update(E=row.get("E"), k=k, tokens=n, d=d, width=f)
        row["tflops"] = flops / (row["fwdbwd_ms"] * 1e-3) / 1e12
        row["pct_of_652"] = 100 * row["tflops"] / DENSE_TFLOPS_ANCHOR
        if dense_row is not None:
            row["dense_ms"] = dense_row["fwdbwd_ms"]
            row["pct_of_dense"] = 100 * row["tflops"] / dense_row["tflops"]
        result["rows"].append(row)
        save()
        print("ROW", json.dumps(row), flush=True)

    def late():
        return time.perf_counter() - T0 > FLAGS.deadline_s

    if "dense_matmul" in FLAGS.paths:
        ks = jax.random.split(jax.random.key(7), 3)
        wd = (jax.random.normal(ks[0], (d, f), dt) * d ** -0.5, jax.random.normal(ks[1], (d, f), dt) * d ** -0.5,
              jax.random.normal(ks[2], (f, d), dt) * f ** -0.5)

        def dense_loss(x, w, r):
            h = glu(x @ w[0], x @ w[1], "swiglu")
            return jnp.sum((h @ w[2]).astype(jnp.float32) * r)

        fn = jax.jit(jax.value_and_grad(dense_loss, (0, 1)))
        sets = []
        for s in range(FLAGS.input_sets):
            kx, kr = jax.random.split(jax.random.key(100 + s))
            sets.append((jax.random.normal(kx, (n * k, d), dt), wd, jax.random.normal(kr, (n * k, d), dt)))
        ms, cs, _, (lo, hi) = time_fn(fn, sets, FLAGS.repeats, FLAGS.warmup)
        dense_row = dict(path="dense_matmul", E=None, fwdbwd_ms=ms, min_ms=lo, max_ms=hi, compile_s=cs)
        add(dense_row)
        del sets

    for e in [int(v) for v in FLAGS.experts]:
        if late():
            print(f"deadline: skipping E={e}", flush=True)
            break
        w = make_weights(1, e, d, f, dt)
        sets = [make_inputs(10 * e + s, n, d, e, k, dt) for s in range(FLAGS.input_sets)]
        cap = expert_capacity(n, k, e, FLAGS.capacity_factor)

        def run(fn_dispatch, **kw):
            def loss(x, w, ids, comb, mask, r):
                y, dropped = fn_dispatch(x, ids, comb, mask, w, activation="swiglu", **kw)
                return jnp.sum(y.astype(jnp.float32) * r), dropped
            g = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
            return lambda x, ids, comb, mask, r: g(x, w, ids, comb, mask, r)

        if "capacity" in FLAGS.paths and not late():
            ms, cs, last, (lo, hi) = time_fn(run(dispatch_capacity, capacity=cap), sets, FLAGS.repeats,
                                             FLAGS.warmup)
            dropped = float(last[0][1]) / (n * k)
            add(dict(path="capacity", E=e, capacity=cap, dropped_fraction=dropped, fwdbwd_ms=ms, min_ms=lo,
                     max_ms=hi, compile_s=cs))
        if "dropless_grouped" in FLAGS.paths:
            for name, cfg in configs.items():
                if late():
                    print(f"deadline: skipping grouped {name} at E={e}", flush=True)
                    break
                try:
                    ms, cs, _, (lo, hi) = time_fn(run(dispatch_grouped, capacity=None, grouped_config=cfg), sets,
                                                  FLAGS.repeats, FLAGS.warmup)
                except Exception as ex:  # noqa: BLE001 - one failing tile config must not end the run
                    print(f"grouped {name} E={e} failed: {ex!r}"[:800], flush=True)
                    result["rows"].append(dict(path="dropless_grouped", E=e, config=name, error=repr(ex)[:600]))
                    save()
                    continue
                add(dict(path="dropless_grouped", E=e, config=name, backend=backend_grouped,
                         forward_tiles=cfg.forward.kwargs(), weight_grad_tiles=cfg.weight_grad.kwargs(),
                         group_lookup=cfg.group_lookup, fwdbwd_ms=ms, min_ms=lo, max_ms=hi, compile_s=cs))
        del sets

    result["meta"]["elapsed_s"] = time.perf_counter() - T0
    save()
    print(f"\n{'path':18s} {'config':14s} {'E':>4s} {'fwdbwd_ms':>10s} {'TFLOP/s':>8s} {'%652':>6s} {'%dense':>7s}")
    for r in result["rows"]:
        if "fwdbwd_ms" not in r:
            print(f"{r['path']:18s} {r.get('config', ''):14s} {str(r['E']):>4s}  FAILED")
            continue
        print(f"{r['path']:18s} {r.get('config', ''):14s} {str(r['E']):>4s} {r['fwdbwd_ms']:10.2f} "
              f"{r['tflops']:8.1f} {r['pct_of_652']:6.1f} {r.get('pct_of_dense', 100.0):7.1f}")
    print(f"elapsed {time.perf_counter() - T0:.0f}s", flush=True)


if __name__ == "__main__":
    app.run(main)
