"""Per-kernel GPU time of chunked KDA from a device trace: the Pallas backend (any tunings) and flash-linear-attention.

  python -m experiments.trace_kda --shape=1x32768x16x128 --tunings="base;separate_output=1" --fla \
      --out=benchmarks/results/kda_trace_h200

Each JAX variant is jitted (forward alone, then forward+backward), warmed up, and `--calls` calls are traced with
`jax.profiler`; the GPU plane's kernel events are summed by kernel name and divided by the number of calls, so
every figure is device time per call, free of host overhead, launch gaps shown apart (`busy` = sum of kernel times,
`span` = first kernel start to last kernel end, per call). fla runs in a child process under `torch.profiler`
(CUDA activity), after its Triton autotuning has finished, with the same inputs' distributions. Writes OUT.json
(rows: source, tuning, gate, pass, kernel, ms, count) and OUT.md (one table per variant and pass).
"""

import collections
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments.bench_kda import G_MIN, numpy_inputs  # also defines --tunings, --fla_timeout

FLAGS = flags.FLAGS
flags.DEFINE_string("shape", "1x32768x16x128", "BxTxHxD (K = V = D, HV = H).")
flags.DEFINE_list("gates", ["bounded"], "bounded (g_min = -5) and/or unbounded.")
flags.DEFINE_list("passes", ["fwd", "fwdbwd"], "Passes of the Pallas variants to trace: fwd and/or fwdbwd.")
flags.DEFINE_integer("calls", 5, "Traced calls per variant and pass.")
flags.DEFINE_bool("fla", False, "Also trace flash-linear-attention's chunk_kda in a child process.")
flags.DEFINE_string("trace_fla_worker", "", "Internal: trace fla for this job file and exit.")
flags.DEFINE_string("out", "", "Output prefix (OUT.json, OUT.md); empty: print only.")

_SKIP_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source", "TraceMe")


def device_kernel_times(trace_dir, calls):
    """{kernel name: (ms per call, launches per call)}, busy and span ms per call, from the newest xplane in
    trace_dir."""
    from jax.profiler import ProfileData
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)[-1]
    data = ProfileData.from_file(path)
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    starts, ends = [], []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        print(f"  {plane.name}: lines {[line.name for line in plane.lines]}", flush=True)
        for line in plane.lines:
            if any(line.name.startswith(s) for s in _SKIP_LINES):
                continue
            for event in line.events:
                per_kernel[event.name][0] += event.duration_ns / 1e6
                per_kernel[event.name][1] += 1
                starts.append(event.start_ns)
                ends.append(event.start_ns + event.duration_ns)
    kernels = {name: (ms / calls, count / calls) for name, (ms, count) in per_kernel.items()}
    busy = sum(ms for ms, _ in kernels.values())
    span = (max(ends) - min(starts)) / 1e6 / calls if starts else float("nan")
    return kernels, busy, span


def trace_jax(fn, args, calls):
    import jax
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="kda_trace_")
    start = time.perf_counter()
    jax.profiler.start_trace(trace_dir)
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    wall = (time.perf_counter() - start) * 1e3 / calls
    kernels, busy, span = device_kernel_times(trace_dir, calls)
    return kernels, busy, span, wall


def _rows(source, tuning, gate, pass_name, kernels, busy, span, wall):
    rows = [dict(source=source, tuning=tuning, gate=gate, **{"pass": pass_name}, kernel=name, ms=ms, count=count)
            for name, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])]
    rows += [dict(source=source, tuning=tuning, gate=gate, **{"pass": pass_name}, kernel=f"[{name}]", ms=value,
                  count=0) for name, value in (("busy", busy), ("span", span), ("wall", wall))]
    return rows


def jax_variants(shape, tuning_text, bounded):
    from experiments.bench_kda import _jax_fns, random_inputs
    from pallas_kernels.kda.pallas_fwd import Tuning
    tuning = Tuning.from_string(tuning_text)
    fwd, grads, _ = _jax_fns("pallas", bounded, tuning)
    args, do = random_inputs(0, *shape, bounded)
    return [("fwd", fwd, args), ("fwdbwd", grads, (*args, do))]


def fla_worker(path):
    import torch
    from torch.profiler import ProfilerActivity, profile
    from fla.ops.kda import chunk_kda
    with open(path) as f:
        job = json.load(f)
    rows = []
    for gate in job["gates"]:
        bounded = gate == "bounded"
        kw = dict(safe_gate=True, lower_bound=G_MIN) if bounded else {}
        x = numpy_inputs(0, *job["shape"], bounded)
        bf = torch.bfloat16
        t = lambda a, dt: torch.tensor(a, device="cuda", dtype=dt).requires_grad_(True)  # noqa: E731
        q, k, v, g, beta = (t(x["q"], bf), t(x["k"], bf), t(x["v"], bf), t(x["g"], torch.float32), t(x["beta"], bf))
        do = torch.randn_like(v)

        def fwd():
            with torch.no_grad():
                return chunk_kda(q, k, v, g, beta, **kw)

        def fwdbwd():
            o, _ = chunk_kda(q, k, v, g, beta, **kw)
            o.backward(do)

        for pass_name, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            start = time.perf_counter()
            for _ in range(3):  # autotuning happens here
                fn()
            torch.cuda.synchronize()
            print(f"fla {gate} {pass_name}: warm-up {time.perf_counter() - start:.0f} s", flush=True)
            calls = job["calls"]
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1e3 / calls
            kernels = {}
            for e in prof.key_averages():
                ms = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
                if ms and e.key and not e.key.startswith("ProfilerStep"):
                    kernels[e.key] = (ms / 1e3 / calls, e.count / calls)
            # Device events only (CUDA activity): kernels and memcpys/memsets; busy is their sum.
            events = [e for e in prof.events() if getattr(e, "device_type", None) is not None
                      and str(e.device_type).endswith("CUDA")]
            span = ((max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3 / calls
                    if events else float("nan"))
            busy = sum(ms for ms, _ in kernels.values())
            rows += _rows("fla", "-", gate, pass_name, kernels, busy, span, wall)
            with open(path + ".out", "w") as f:
                json.dump(rows, f)


def run_fla(shape, gates, calls):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.json")
        with open(path, "w") as f:
            json.dump(dict(shape=list(shape), gates=list(gates), calls=calls), f)
        cmd = [sys.executable, "-m", "experiments.trace_kda", f"--trace_fla_worker={path}"]
        try:
            subprocess.run(cmd, check=True, timeout=FLAGS.fla_timeout)
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as err:
            print(f"fla child failed: {err}", flush=True)
        if os.path.exists(path + ".out"):
            with open(path + ".out") as f:
                return json.load(f)
    return []


def markdown(rows, shape):
    lines = [f"# Per-kernel device time, chunked KDA, B x T x H x D = {' x '.join(map(str, shape))}", "",
             "ms per call from a device trace (`experiments/trace_kda.py`); `[busy]` sum of kernel times, `[span]` "
             "first kernel start to last kernel end, `[wall]` host wall clock per call while tracing.", ""]
    groups = collections.OrderedDict()
    for row in rows:
        groups.setdefault((row["source"], row["tuning"], row["gate"], row["pass"]), []).append(row)
    for (source, tuning, gate, pass_name), group in groups.items():
        lines += [f"## {source} {gate} {pass_name} (tuning {tuning})", "", "| kernel | ms | launches |", "|---|---:|---:|"]
        lines += [f"| `{r['kernel'][:90]}` | {r['ms']:.3f} | {r['count']:.0f} |" for r in group]
        lines.append("")
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.trace_fla_worker:
        fla_worker(FLAGS.trace_fla_worker)
        return
    shape = tuple(int(s) for s in FLAGS.shape.split("x"))
    rows = []

    def save(new):
        """Prints the tables of the `new` rows and (--out) writes every row so far."""
        print(markdown(new, shape), flush=True)
        text = markdown(rows, shape)
        if FLAGS.out:
            os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
            with open(FLAGS.out + ".json", "w") as f:
                json.dump(dict(shape=shape, rows=rows, versions=_versions()), f, indent=1)
            with open(FLAGS.out + ".md", "w") as f:
                f.write(text + "\n")

    if FLAGS.fla:  # first: its autotuning must not compete with anything
        new = run_fla(shape, FLAGS.gates, FLAGS.calls)
        rows += new
        save(new)
    for gate in FLAGS.gates:
        for tuning in (FLAGS.tunings or FLAGS.tuning).split(";"):
            for pass_name, fn, args in jax_variants(shape, tuning, gate == "bounded"):
                if pass_name not in FLAGS.passes:
                    continue
                start = time.perf_counter()
                kernels, busy, span, wall = trace_jax(fn, args, FLAGS.calls)
                print(f"pallas {gate} {tuning} {pass_name}: busy {busy:.3f} ms, span {span:.3f} ms, wall "
                      f"{wall:.3f} ms ({time.perf_counter() - start:.0f} s with compile)", flush=True)
                new = _rows("pallas", tuning, gate, pass_name, kernels, busy, span, wall)
                rows += new
                save(new)


def _versions():
    import jax
    return dict(jax=jax.__version__, device=str(jax.devices()[0].device_kind))


if __name__ == "__main__":
    app.run(main)
