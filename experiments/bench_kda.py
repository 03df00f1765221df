"""Times chunked KDA forward and forward+backward: the Pallas kernels, the chunked XLA version and
flash-linear-attention (fla) side by side, each verified against the token-by-token reference before it is timed.

  python -m experiments.bench_kda --out_dir=benchmarks/results

fla (PyTorch) runs in a child process so the two frameworks never compute at once: after the JAX variants, or
first with --fla_first (its Triton autotuning takes minutes on a fresh machine; first, it cannot be starved by the
JAX rows). --overlap_compile has the parent compile every Pallas row meanwhile: faster, but it loads the host while
fla autotunes and times, which may cost fla forward time (off by default; kda_v12_h200/README.md). Run the parent
with XLA_PYTHON_CLIENT_PREALLOCATE=false so that the child has the GPU's memory. The Pallas variants run once per
entry of --tunings. Rows go to kda_h200.json and a markdown table to kda_h200.md (kda_<card>.* when the device is not
an H200, e.g. kda_h100.*), rewritten after every row, so a run stopped by --deadline_s or a time limit keeps what it
measured. Both frameworks are timed by CUDA events around each call: fla by triton's do_bench, the JAX rows by
experiments/cuda_events.py (--timer; on a CPU dry run, the host clock).
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["1x8192x16x128", "1x32768x16x128", "4x8192x16x128", "1x131072x16x128"],
                  "BxTxHxD shapes (K = V = D, HV = H).")
flags.DEFINE_list("variants", ["pallas_bounded", "pallas_unbounded", "xla_bounded", "xla_unbounded",
                               "fla_bounded", "fla_unbounded"],
                  "Variants to time: {pallas, pallas-split, xla, fla}_{bounded, unbounded}; pallas-split forces "
                  "Tuning(separate_output=True) on top of each tuning.")
flags.DEFINE_integer("repeats", 30, "Timed repeats per measurement (median reported).")
flags.DEFINE_integer("xla_repeats", 3, "Timed repeats for the (slow) xla variants.")
flags.DEFINE_bool("verify", True, "Check each JAX variant against the reference before timing it.")
flags.DEFINE_integer("verify_len", 1024, "Sequence length of the check against the token-by-token reference.")
flags.DEFINE_string("tuning", "base", "Launch tuning of the Pallas variants: 'base' (the defaults of "
                    "pallas_fwd.Tuning) or 'field=value,...' changes to them.")
flags.DEFINE_string("tunings", "", "Several launch tunings separated by ';' (each as --tuning): every Pallas "
                    "variant is timed with each. Overrides --tuning when set.")
flags.DEFINE_list("tuned", [], "Pallas variants that run every --tunings entry (empty: all of them); the other "
                  "Pallas variants run the first entry only.")
flags.DEFINE_bool("fla_first", False, "Run the fla child before the JAX variants.")
flags.DEFINE_bool("overlap_compile", False, "With --fla_first: compile every Pallas row ahead of time (CPU only) "
                  "while the fla child runs, instead of after it. Faster, but the host load may slow fla's "
                  "launch-bound forward and skew its autotuning (benchmarks/results/kda_v12_h200/README.md).")
flags.DEFINE_enum("timer", "events", ["events", "wall", "both"], "How the JAX rows are timed: CUDA events around "
                  "each call (experiments/cuda_events.py, as do_bench times fla), host wall clock over samples of 4 "
                  "calls with one synchronisation each, or both (the wall figures as extra fields).")
flags.DEFINE_float("deadline_s", 0.0, "Start no new JAX measurement after this many seconds (0: no deadline).")
flags.DEFINE_string("out_dir", "benchmarks/results", "Where kda_<card>.json / .md are written (card: h200, h100...).")
flags.DEFINE_string("plot_from", "", "Only redraw the chart of an earlier run's kda_<card>.json (written beside it "
                    "as .png) and exit.")
flags.DEFINE_string("fla_worker", "", "Internal: run the fla timings for this job file and exit.")
flags.DEFINE_integer("fla_timeout", 400, "Seconds the fla child may take; the JAX rows are written before it starts.")

G_MIN = -5.0
BANDWIDTH = 4.3e12  # measured device-to-device copy rate of the H200, bytes/s
BARS = {"o": 0.005, "state": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02}


def numpy_inputs(seed, batch, seq_len, heads, dim, bounded):
    """fla's benchmark distributions: q ~ N(0, 1), k L2-normalised, v ~ N(0, 1), g = -5 sigmoid(N) (bounded) or
    -softplus(N), beta = sigmoid(N). Float32 numpy; the caller casts q, k, v, beta to bf16."""
    rng = np.random.default_rng(seed)
    shape = (batch, seq_len, heads, dim)
    q = rng.standard_normal(shape, np.float32)
    k = rng.standard_normal(shape, np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal(shape, np.float32)
    raw = rng.standard_normal(shape, np.float32)
    g = G_MIN / (1 + np.exp(-raw)) if bounded else -np.logaddexp(0, raw)
    beta = 1 / (1 + np.exp(-rng.standard_normal(shape[:3], np.float32)))
    return dict(q=q, k=k, v=v, g=g.astype(np.float32), beta=beta.astype(np.float32))


def random_inputs(seed, batch, seq_len, heads, dim, bounded):
    """numpy_inputs' distributions drawn on the device with jax.random (the timed shapes reach 268M elements per
    array, which numpy draws in tens of seconds), bf16 q, k, v, beta and fp32 g, and a bf16 output cotangent."""
    import jax
    import jax.numpy as jnp
    keys = jax.random.split(jax.random.key(seed), 6)
    shape = (batch, seq_len, heads, dim)

    @jax.jit
    def draw():
        normal = lambda key, s=shape: jax.random.normal(key, s, jnp.float32)  # noqa: E731
        k = normal(keys[1])
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        raw = normal(keys[3])
        g = G_MIN * jax.nn.sigmoid(raw) if bounded else -jax.nn.softplus(raw)
        beta = jax.nn.sigmoid(normal(keys[4], shape[:3]))
        bf = jnp.bfloat16
        return ([normal(keys[0]).astype(bf), k.astype(bf), normal(keys[2]).astype(bf), g, beta.astype(bf)],
                normal(keys[5]).astype(bf))

    return draw()


def floor_ms(batch, seq_len, heads, dim):
    """Memory floor of the forward: q, k, v bf16 and g fp32 read once, o bf16 written once."""
    return batch * seq_len * heads * (3 * 2 * dim + 4 * dim + 2 * dim) / BANDWIDTH * 1e3


# The backward moves about 2.2x the forward's bytes, so the forward+backward floor is this multiple of floor_ms.
FWDBWD_FLOOR = 3.2


_EVENTS = []  # the CudaEvents timer, once built


def _median_ms(fn, inputs, repeats):
    """Median ms per call: CUDA events around each call (--timer=events, cuda_events.CudaEvents) or host wall
    clock over samples of 4 calls (--timer=wall, cuda_events.wall_median_ms); {"events": ms, "wall": ms} for
    --timer=both."""
    from experiments import cuda_events
    import jax
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs[0]))
    print(f"    first call {time.perf_counter() - start:.1f} s", flush=True)
    out = {}
    timer = FLAGS.timer
    if timer != "wall" and jax.default_backend() != "gpu":  # a CPU dry run: no CUDA events to record
        print(f"    --timer={timer} needs a GPU; timing by the host clock on {jax.default_backend()}", flush=True)
        timer = "wall"
    if timer in ("events", "both"):
        if not _EVENTS:
            _EVENTS.append(cuda_events.CudaEvents())
        out["events"] = _EVENTS[0].median_ms(fn, inputs, repeats)
    if timer in ("wall", "both"):
        out["wall"] = cuda_events.wall_median_ms(fn, inputs, repeats)
    return out


def _jax_fns(backend, bounded, tuning):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.kda import api
    from pallas_kernels.kda.pallas_op import kda_pallas
    g_min = G_MIN if bounded else None

    def forward(q, k, v, g, beta):
        if backend in ("pallas", "pallas-split"):  # the public op's pallas path, with this run's tuning
            split = tuning.separate_output or backend == "pallas-split"
            run_tuning = dataclasses.replace(tuning, separate_output=split)
            diagonal = api.kda_diagonal_path(g_min, 64)
            s0 = jnp.zeros((q.shape[0], v.shape[2], q.shape[3], v.shape[3]), jnp.float32)
            interpret = jax.default_backend() == "cpu"  # a CPU dry run of the script: interpret mode
            run = api._whole_chunks(lambda *a, **kw: kda_pallas(*a, **kw, tuning=run_tuning, interpret=interpret))
            return run(q, k, v, g, beta, s0, None, scale=q.shape[-1] ** -0.5, chunk_size=64, diagonal=diagonal)
        return api.chunk_kda(q, k, v, g, beta, g_min=g_min, backend=backend, output_final_state=True)

    def grads(q, k, v, g, beta, do):
        """o and the input gradients: o is returned so that a training step's whole forward is timed (a kernel that
        only writes o, as with Tuning.separate_output, would otherwise be dropped as dead code)."""
        (o, _), vjp = jax.vjp(forward, q, k, v, g, beta)
        return o, vjp((do, jnp.zeros((q.shape[0], v.shape[2], q.shape[3], v.shape[3]), jnp.float32)))

    return jax.jit(lambda *a: forward(*a)[0]), jax.jit(grads), forward


def _device_inputs(np_inputs, seed):
    import jax.numpy as jnp
    bf = jnp.bfloat16
    x = np_inputs
    do = np.random.default_rng(seed + 1000).standard_normal(x["v"].shape, np.float32)
    return [jnp.asarray(x["q"], bf), jnp.asarray(x["k"], bf), jnp.asarray(x["v"], bf), jnp.asarray(x["g"]),
            jnp.asarray(x["beta"], bf)], jnp.asarray(do, bf)


def reference_outputs(np_inputs, do):
    """Token-by-token fp32 reference: o, final state and the gradients of <o, do> for the (bf16-rounded) inputs."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.kda import chunk_kda
    args = [jnp.asarray(np.asarray(jnp.asarray(np_inputs[n], jnp.bfloat16 if n != "g" else jnp.float32),
                                   np.float32)) for n in ("q", "k", "v", "g", "beta")]
    f = lambda *a: chunk_kda(*a, backend="reference", output_final_state=True)  # noqa: E731
    (o, state), vjp = jax.vjp(f, *args)
    grads = vjp((jnp.asarray(do, jnp.float32), jnp.zeros_like(state)))
    return dict(zip(("o", "state", "dq", "dk", "dv", "dg", "dbeta"), (o, state, *grads)))


def error_ratio(ref, out):
    """max over outputs of relative RMS error / its bar, and the per-output errors."""
    from pallas_kernels.kda import relative_rms_error
    errs = {n: relative_rms_error(ref[n], np.asarray(out[n], np.float32)) for n in ref if n in out}
    return max(errs[n] / BARS[n] for n in errs), errs


def _verify_jax(backend, bounded, tuning, heads, dim, batch=1):
    import jax.numpy as jnp
    x = numpy_inputs(7, batch, FLAGS.verify_len, heads, dim, bounded)
    args, do = _device_inputs(x, 7)
    ref = reference_outputs(x, np.asarray(do, np.float32))
    _, grads, forward = _jax_fns(backend, bounded, tuning)
    o, state = forward(*args)
    _, d = grads(*args, do)
    out = dict(zip(("o", "state", "dq", "dk", "dv", "dg", "dbeta"), (o, state, *d)))
    out = {n: jnp.asarray(a, jnp.float32) for n, a in out.items()}
    return error_ratio(ref, out)


_VERIFIED = {}
_COMPILED = {}


def _compiled_fns(shape, variant, tuning, tuning_name):
    """The timed forward and forward+backward of a row, compiled for its shape ahead of time (memoised): compiling
    needs no GPU time, so it can overlap the fla child's (precompile)."""
    key = (shape, variant, tuning_name)
    if key not in _COMPILED:
        import jax
        import jax.numpy as jnp
        backend, gate = variant.split("_")
        fwd, grads, _ = _jax_fns(backend, gate == "bounded", tuning)
        tokens = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        args = (tokens, tokens, tokens, jax.ShapeDtypeStruct(shape, jnp.float32),
                jax.ShapeDtypeStruct(shape[:3], jnp.bfloat16))
        start = time.perf_counter()
        _COMPILED[key] = fwd.lower(*args).compile(), grads.lower(*args, tokens).compile()
        print(f"    compiled {variant} [{tuning_name}] {shape} in {time.perf_counter() - start:.1f} s", flush=True)
    return _COMPILED[key]


# Tuning fields that only the unbounded gate's kernels read: a bounded row that differs from an earlier one in
# these alone would time the same kernels again.
_UNBOUNDED_ONLY = ("diagonal_kernel", "diagonal_warps", "diagonal_bwd_warps", "pairwise_warps")


def row_tunings(variant, tunings):
    """The (name, Tuning) entries a variant runs: every --tunings entry for a Pallas variant in --tuned (or with
    --tuned empty), else the first, less the bounded gate's repeats (entries equal to an earlier one but for fields
    only the unbounded gate reads); ("-", None) for the others."""
    if not variant.startswith("pallas"):
        return [("-", None)]
    chosen = tunings if not FLAGS.tuned or variant in FLAGS.tuned else tunings[:1]
    if not variant.endswith("_bounded"):
        return chosen
    from pallas_kernels.kda.pallas_fwd import Tuning
    defaults = {f: getattr(Tuning(), f) for f in _UNBOUNDED_ONLY}
    seen, rows = set(), []
    for name, tuning in chosen:
        key = dataclasses.replace(tuning, **defaults)
        if key not in seen:
            seen.add(key)
            rows.append((name, tuning))
    return rows


def precompile(shapes, tunings):
    """Compiles every Pallas row of the run (a row that fails to compile is reported when its turn comes)."""
    for shape in shapes:
        for variant in (v for v in FLAGS.variants if v.startswith("pallas")):
            for name, tuning in row_tunings(variant, tunings):
                try:
                    _compiled_fns(shape, variant, tuning, name)
                except Exception as err:  # noqa: BLE001 - bench_jax compiles it again and reports the failure
                    print(f"    compile of {variant} [{name}] {shape} failed: {type(err).__name__}", flush=True)


def bench_jax(shape, variant, tuning, tuning_name="base"):
    import jax
    backend, gate = variant.split("_")
    bounded = gate == "bounded"
    batch, seq_len, heads, dim = shape
    if not FLAGS.verify:
        ratio, errs = float("nan"), {}
    elif (variant, tuning_name, batch, heads, dim) in _VERIFIED:
        ratio, errs = _VERIFIED[variant, tuning_name, batch, heads, dim]
    else:  # at the row's batch, heads and width (the kernels a tuning picks may depend on them: mosaic_output_programs)
        ratio, errs = _VERIFIED[variant, tuning_name, batch, heads, dim] = _verify_jax(backend, bounded, tuning, heads,
                                                                                       dim, batch)
    print(f"  verify {variant} B={batch} T={FLAGS.verify_len}: max err/bar {ratio:.3f} {errs}", flush=True)
    fwd, grads = _compiled_fns(shape, variant, tuning, tuning_name)
    sets = [random_inputs(s, batch, seq_len, heads, dim, bounded) for s in range(3)]
    repeats = FLAGS.xla_repeats if backend == "xla" else FLAGS.repeats
    fwd_ms = _median_ms(fwd, [a for a, _ in sets], repeats)
    fwdbwd_ms = _median_ms(grads, [(*a, do) for a, do in sets], repeats)
    out = fwd(*sets[0][0])
    del sets
    main = "events" if "events" in fwd_ms else "wall"
    times = dict(fwd_ms=fwd_ms[main], fwdbwd_ms=fwdbwd_ms[main], timer=main)
    if len(fwd_ms) > 1:
        times.update(fwd_ms_wall=fwd_ms["wall"], fwdbwd_ms_wall=fwdbwd_ms["wall"])
    return dict(**times, max_err_ratio=ratio, errors=errs), jax.device_get(out)


def start_fla_child(jobs):
    """Starts the fla timings in a child process (PyTorch only); finish_fla_child collects its rows."""
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "kda_fla_jobs.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    cmd = [sys.executable, "-m", "experiments.bench_kda", f"--fla_worker={path}",
           f"--repeats={FLAGS.repeats}", f"--verify_len={FLAGS.verify_len}"]
    if os.path.exists(path + ".out"):
        os.remove(path + ".out")
    return dict(process=subprocess.Popen(cmd), path=path, start=time.perf_counter(), runs=len(jobs["runs"]))


def finish_fla_child(child):
    """Waits for the child until --fla_timeout after its start (then stops it); returns the rows it wrote."""
    process, path, start = child["process"], child["path"], child["start"]
    try:
        process.wait(timeout=max(1.0, FLAGS.fla_timeout - (time.perf_counter() - start)))
        if process.returncode:
            print(f"fla child failed (exit {process.returncode}) after {time.perf_counter() - start:.0f} s", flush=True)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        print(f"fla child stopped at its {FLAGS.fla_timeout} s limit", flush=True)
    if not os.path.exists(path + ".out"):
        return dict(rows=[], fla="not run", torch="-")
    with open(path + ".out") as f:
        result = json.load(f)
    print(f"fla child: {len(result['rows'])} of {child['runs']} rows in {time.perf_counter() - start:.0f} s",
          flush=True)
    return result


def _fla_tensors(x, do):
    import torch
    bf = torch.bfloat16
    t = lambda a, dt: torch.tensor(a, device="cuda", dtype=dt).requires_grad_(True)  # noqa: E731
    return ([t(x["q"], bf), t(x["k"], bf), t(x["v"], bf), t(x["g"], torch.float32), t(x["beta"], bf)],
            torch.tensor(do, device="cuda", dtype=bf))


def _fla_errors(chunk_kda, kw, ref_all, gate):
    """fla's outputs and gradients at verify_len against the token-by-token reference computed by the parent."""
    x = {n: ref_all[f"{gate}_in_{n}"] for n in ("q", "k", "v", "g", "beta")}
    (q, k, v, g, beta), do = _fla_tensors(x, ref_all[f"{gate}_do"])
    o, state = chunk_kda(q, k, v, g, beta, output_final_state=True, **kw)
    o.backward(do)
    out = dict(o=o, state=state, dq=q.grad, dk=k.grad, dv=v.grad, dg=g.grad, dbeta=beta.grad)
    out = {n: a.detach().float().cpu().numpy() for n, a in out.items()}
    return error_ratio({n: ref_all[f"{gate}_ref_{n}"] for n in BARS}, out)


def _fla_times(chunk_kda, kw, shape, bounded):
    import torch
    from triton.testing import do_bench
    torch.manual_seed(0)  # numpy_inputs' distributions, drawn on the GPU
    bf, f32, norm = torch.bfloat16, torch.float32, lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    raw = norm(*shape)
    g = G_MIN * torch.sigmoid(raw) if bounded else -torch.nn.functional.softplus(raw)
    leaf = lambda a, dt: a.to(dt).requires_grad_(True)  # noqa: E731
    q, k = leaf(norm(*shape), bf), leaf(torch.nn.functional.normalize(norm(*shape), dim=-1), bf)
    v, g, beta = leaf(norm(*shape), bf), leaf(g, f32), leaf(torch.sigmoid(norm(*shape[:3])), bf)
    do = norm(*shape).to(bf)
    del raw

    def fwdbwd():
        o, _ = chunk_kda(q, k, v, g, beta, **kw)
        o.backward(do)

    fwd_ms = do_bench(lambda: chunk_kda(q, k, v, g, beta, **kw), warmup=25, rep=100, return_mode="median")
    return fwd_ms, do_bench(fwdbwd, warmup=25, rep=100, return_mode="median")


def fla_worker(path):
    import fla
    import torch
    from fla.ops.kda import chunk_kda
    with open(path) as f:
        jobs = json.load(f)
    ref_all = np.load(jobs["reference"])
    rows = []
    for job in jobs["runs"]:
        batch, seq_len, heads, dim = job["shape"]
        bounded = job["variant"] == "fla_bounded"
        kw = dict(safe_gate=True, lower_bound=G_MIN) if bounded else {}
        ratio, errs = _fla_errors(chunk_kda, kw, ref_all, "bounded" if bounded else "unbounded")
        fwd_ms, fwdbwd_ms = _fla_times(chunk_kda, kw, job["shape"], bounded)
        rows.append(dict(variant=job["variant"], tuning="-", B=batch, T=seq_len, H=heads, D=dim, fwd_ms=fwd_ms,
                         fwdbwd_ms=fwdbwd_ms, max_err_ratio=ratio, errors=errs))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
        with open(path + ".out", "w") as f:  # after every row: a timed-out child keeps what it measured
            json.dump(dict(rows=rows, fla=fla.__version__, torch=torch.__version__), f)


def save_fla_references(path, heads, dim):
    """Inputs and token-by-token references at verify_len for the fla child, both gates."""
    arrays = {}
    for bounded in (True, False):
        gate = "bounded" if bounded else "unbounded"
        x = numpy_inputs(7, 1, FLAGS.verify_len, heads, dim, bounded)
        do = np.random.default_rng(1007).standard_normal(x["v"].shape, np.float32)
        ref = reference_outputs(x, do)
        arrays.update({f"{gate}_in_{n}": a for n, a in x.items()})
        arrays[f"{gate}_do"] = do
        arrays.update({f"{gate}_ref_{n}": np.asarray(a) for n, a in ref.items()})
    np.savez(path, **arrays)


def result_name(device_kind):
    """kda_h200 on an H200; else kda_ and the card's model (kda_h100 for "NVIDIA H100 80GB HBM3"), so rows measured
    on another card never land in the H200 file."""
    match = re.search(r"\b([A-Z]+\d+[A-Za-z]*)\b", device_kind.replace("NVIDIA", ""))
    return "kda_" + (match.group(1).lower() if match else re.sub(r"\W+", "_", device_kind).strip("_").lower())


def write_tables(rows, versions, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    name = result_name(versions["gpu"])
    keys = ("variant", "tuning", "B", "T", "H", "D", "fwd_ms", "fwdbwd_ms", "timer", "fwd_ms_wall", "fwdbwd_ms_wall",
            "max_err_ratio", "errors")
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump([{k: ({n: float(e) for n, e in r[k].items()} if k == "errors" else r[k]) for k in keys if k in r}
                   for r in rows], f, indent=1)
    lines = [f"Chunked KDA on {versions['gpu']} (jax {versions['jax']}, jaxlib {versions['jaxlib']}, "
             f"fla {versions.get('fla', '-')}, torch {versions.get('torch', '-')}); bf16 q/k/v/beta, fp32 g, "
             "K = V = D, HV = H, chunk 64. Medians over rotating 3 input sets: JAX rows timed as their `timer` field "
             "says (events: CUDA events around each call, experiments/cuda_events.py; wall: host clock over samples "
             "of 4 calls with one synchronisation each), fla rows by triton's do_bench (CUDA events). "
             "max_err_ratio = max over o, state, dq, dk, dv, dg, dbeta of "
             "(relative RMS error vs the fp32 token-by-token reference) / bar, at T = "
             f"{FLAGS.verify_len}. Floor: forward bytes B*T*H*(3*2*D + 4*D + 2*D) at 4.3 TB/s; the backward moves "
             f"{FWDBWD_FLOOR - 1:.1f}x that, so the fwd+bwd floor is {FWDBWD_FLOOR}x the forward's. "
             f"Pallas launch tuning: {versions.get('tuning', '-')}.",
             "", "| variant | tuning | timer | B | T | H | D | fwd ms | x floor | fwd+bwd ms | x floor | max err/bar |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        floor = floor_ms(r["B"], r["T"], r["H"], r["D"])
        timer = r.get("timer", "events" if r["variant"].startswith("fla") else "wall")
        lines.append(f"| {r['variant']} | {r['tuning']} | {timer} | {r['B']} | {r['T']} | {r['H']} | {r['D']} | "
                     f"{r['fwd_ms']:.3f} | "
                     f"{r['fwd_ms'] / floor:.1f} | {r['fwdbwd_ms']:.3f} | "
                     f"{r['fwdbwd_ms'] / (FWDBWD_FLOOR * floor):.1f} | "
                     f"{r['max_err_ratio']:.3f} |")
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def write_plot(rows, path, title):
    """Each row's forward and forward+backward time as a multiple of its memory floor, one group of bars per
    shape, so that the four shapes share one axis; the milliseconds are written on the bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["B"], r["T"], r["H"], r["D"]) for r in rows}, key=lambda s: (s[0] * s[1], s[0]))
    series = list(dict.fromkeys((r["variant"], r.get("tuning", "-")) for r in rows))
    by_key = {(r["variant"], r.get("tuning", "-"), r["B"], r["T"], r["H"], r["D"]): r for r in rows}
    width = 0.8 / len(series)
    fig, axes = plt.subplots(1, 2, figsize=(6 + 1.6 * len(shapes), 4.2), sharey=True)
    panels = ((axes[0], "fwd_ms", 1.0, "forward"), (axes[1], "fwdbwd_ms", FWDBWD_FLOOR, "forward+backward"))
    for ax, key, scale, label in panels:
        for i, (variant, tuning) in enumerate(series):
            xs, ys, ms = [], [], []
            for j, shape in enumerate(shapes):
                row = by_key.get((variant, tuning, *shape))
                if row is not None:
                    xs.append(j - 0.4 + (i + 0.5) * width)
                    ys.append(row[key] / (scale * floor_ms(*shape)))
                    ms.append(row[key])
            name = variant if tuning in ("-", "base") else f"{variant} [{tuning}]"
            bars = ax.bar(xs, ys, width, label=name,
                          color=f"C{i}", hatch="//" if variant.endswith("unbounded") else None, edgecolor="white")
            ax.bar_label(bars, [f"{m:.2f}" for m in ms], fontsize=6, rotation=90, padding=2)
        ax.set_xticks(range(len(shapes)), [f"{b}x{t // 1024}K" for b, t, _, _ in shapes])
        ax.set_title(f"{label} (ms on the bars)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("time / memory floor at 4.3 TB/s")
    axes[0].set_ylim(0, axes[0].get_ylim()[1] * 1.12)
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _versions():
    import jax
    import jaxlib
    from pallas_kernels.kda.pallas_fwd import Tuning
    return dict(gpu=jax.devices()[0].device_kind, jax=jax.__version__, jaxlib=jaxlib.__version__,
                tuning="; ".join(f"{t} = {Tuning.from_string(t)!r}" for t in _tuning_names()))


def _tuning_names():
    return [t.strip() for t in FLAGS.tunings.split(";") if t.strip()] if FLAGS.tunings else [FLAGS.tuning]


def main(argv):
    del argv
    if FLAGS.fla_worker:
        return fla_worker(FLAGS.fla_worker)
    if FLAGS.plot_from:
        with open(FLAGS.plot_from) as f:
            rows = json.load(f)
        if not rows:
            raise app.UsageError(f"--plot_from: {FLAGS.plot_from} holds no rows")
        path = os.path.splitext(FLAGS.plot_from)[0] + ".png"
        write_plot(rows, path, f"Chunked KDA, H = {rows[0]['H']}, D = {rows[0]['D']}, bf16 "
                               f"({os.path.basename(FLAGS.plot_from)})")
        return print(f"wrote {path}")
    import jax
    from pallas_kernels.kda.pallas_fwd import Tuning
    start = time.perf_counter()
    tunings = [(name, Tuning.from_string(name)) for name in _tuning_names()]
    pallas_variants = [v for v in FLAGS.variants if v.startswith("pallas")]
    if not set(FLAGS.tuned) <= set(pallas_variants):
        raise app.UsageError(f"--tuned must name Pallas variants of --variants {pallas_variants}, got {FLAGS.tuned}")
    shapes = [tuple(int(s) for s in shape.split("x")) for shape in FLAGS.shapes]
    fla_jobs = [dict(shape=shape, variant=v) for shape in shapes for v in FLAGS.variants if v.startswith("fla")]
    order = {v: i for i, v in enumerate(FLAGS.variants)}
    rows, versions = [], _versions()

    def save():
        rows.sort(key=lambda r: (r["T"] * r["B"], r["B"], order[r["variant"]]))
        write_tables(rows, versions, FLAGS.out_dir)

    def run_fla(overlap=False):
        ref_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "kda_fla_ref.npz")
        save_fla_references(ref_path, shapes[0][2], shapes[0][3])
        jax.clear_caches()
        child = start_fla_child(dict(reference=ref_path, runs=fla_jobs))
        if overlap:
            precompile(shapes, tunings)
        result = finish_fla_child(child)
        rows.extend(result["rows"])
        versions.update(fla=result["fla"], torch=result["torch"])
        save()

    if fla_jobs and FLAGS.fla_first:
        run_fla(overlap=FLAGS.overlap_compile)
    for shape in shapes:
        outs = {}
        for variant in FLAGS.variants:
            if variant.startswith("fla"):
                continue
            for name, tuning in row_tunings(variant, tunings):
                if FLAGS.deadline_s and time.perf_counter() - start > FLAGS.deadline_s:
                    print(f"deadline: {variant} {name} {shape} not run", flush=True)
                    continue
                print(f"{variant} [{name}] {shape}", flush=True)
                try:
                    result, outs[variant] = bench_jax(shape, variant, tuning or Tuning(), name)
                except Exception as err:  # one variant failing to lower or run must not cost the others' rows
                    print(f"  FAILED {variant} [{name}] {shape}: {type(err).__name__}: {err}"[:2000], flush=True)
                    continue
                rows.append(dict(variant=variant, tuning=name, B=shape[0], T=shape[1], H=shape[2], D=shape[3],
                                 **result))
                print(f"  {rows[-1]}", flush=True)
                save()  # a timed-out run keeps what it measured
        for gate in ("bounded", "unbounded"):  # full-shape agreement of the kernels with the XLA path
            if f"pallas_{gate}" in outs and f"xla_{gate}" in outs:
                from pallas_kernels.kda import relative_rms_error
                err = relative_rms_error(np.asarray(outs[f"xla_{gate}"], np.float32),
                                         np.asarray(outs[f"pallas_{gate}"], np.float32))
                print(f"  full-shape o, pallas vs xla ({gate}): relative RMS {err:.2e}", flush=True)
    if fla_jobs and not FLAGS.fla_first:
        run_fla()
    save()
    if rows:  # the chart is a view of the rows just written: failing to draw it must not fail the run
        path = os.path.join(FLAGS.out_dir, result_name(versions["gpu"]) + ".png")
        try:
            write_plot(rows, path, f"Chunked KDA on {versions['gpu']}, H = {rows[0]['H']}, D = {rows[0]['D']}, bf16")
            print(f"wrote {path}")
        except Exception as err:  # e.g. no matplotlib beside the benchmark's JAX
            print(f"chart not drawn ({type(err).__name__}: {err}); redraw with --plot_from", flush=True)


if __name__ == "__main__":
    app.run(main)
