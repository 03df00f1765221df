"""Where the time of the forward's scores kernel goes: the Pallas inference forward (bounded gate) with one stage of
`kda_scores_fwd` left out or changed at a time, each CUDA-event-timed (experiments/cuda_events.py) beside the
unchanged kernel. H200.md's method without hardware counters: time variants that leave a stage out and take
differences.

  python -m experiments.ablate_kda_scores --shape=4x8192x16x128   (--shape: profile_kda's flag)

Variants (--ablations): base; no_solve (T = Akk: no inverse); no_gated (the gated inputs qg, kb, kd, d not
written); no_products (the decayed-score products replaced by zeros: what remains is the decay exponentials, the
masks and the solve); no_gate_sums (no prefix sum of the gates and no anchor or last-row extraction: the
cumulative gates are the gates themselves and every anchor is 0); no_exp (every decay factor of the per-chunk
algebra a compare and select instead of an exponential); any `t:FIELD=VALUE,...` (a Tuning, as bench_kda's
--tunings, e.g. t:cumulative_gates=1). Leaving a stage out makes the outputs wrong by design: each row also prints
its forward's error against the reference (o and the final state at bench_kda's --verify_len) so that a variant
that is right (a tuning) can be judged on both.
"""

import contextlib
import time
import types

import numpy as np
from absl import app, flags

from experiments import bench_kda, profile_kda  # noqa: F401 - profile_kda: the --shape flag (BxTxHxD)

flags.DEFINE_string("ablations", "base;no_solve;no_gated;no_products;no_gate_sums;no_exp;t:solve_operands=tf32;"
                    "t:cumulative_gates=1;t:cumulative_gates=1,fused_outputs=1;"
                    "t:cumulative_gates=1,fused_outputs=1,scan_lookahead=1",
                    "Variants to time, in order (see the module docstring), separated by ';' (or by ',' when no "
                    "tuning among them changes more than one field).")
flags.DEFINE_integer("timed_calls", 30, "Event-timed calls per variant (median reported).")
FLAGS = flags.FLAGS

STAGES = ("base", "no_solve", "no_gated", "no_products", "no_gate_sums", "no_exp")


@contextlib.contextmanager
def patched(name):
    """Within: pallas_fwd with the stage `name` left out or changed (module attributes swapped at trace time)."""
    import jax.numpy as jnp
    from pallas_kernels.kda import pallas_chunk, pallas_fwd
    if name not in STAGES:
        raise ValueError(f"ablation must be one of {STAGES} or t:FIELD=VALUE,..., got {name!r}")

    def zero_scores(x, dec, **kw):
        del dec, kw
        return (jnp.zeros((x.q.shape[0],) * 2, jnp.float32),) * 2

    no_exp = types.SimpleNamespace(**{n: getattr(jnp, n) for n in dir(jnp) if not n.startswith("__")})
    no_exp.exp = lambda x: jnp.where(x > -1e30, 1.0, 0.0).astype(x.dtype)
    swaps = {"no_solve": [(pallas_fwd, "_solve", lambda beta_ref, akk, bf16=False: akk)],
             "no_gated": [(pallas_fwd, "_write_gated", lambda *a: None)],
             "no_products": [(pallas_fwd, "partial_scores", zero_scores)],
             "no_gate_sums": [(pallas_chunk, "cumsum_rows", lambda x: x),
                              (pallas_chunk, "row", lambda x, i: jnp.zeros(x.shape[1:], x.dtype))],
             "no_exp": [(pallas_chunk, "jnp", no_exp)]}
    originals = [(module, attr, getattr(module, attr)) for module, attr, _ in swaps.get(name, [])]
    for module, attr, value in swaps.get(name, []):
        setattr(module, attr, value)
    try:
        yield
    finally:
        for module, attr, value in originals:
            setattr(module, attr, value)


def variants(text):
    """--ablations as a list: split at ';', or at ',' if there is no ';'."""
    return [name.strip() for name in text.split(";" if ";" in text else ",") if name.strip()]


def main(argv):
    del argv
    import jax
    from experiments.cuda_events import CudaEvents, wall_median_ms
    from pallas_kernels.kda.pallas_fwd import Tuning
    shape = tuple(int(s) for s in FLAGS.shape.split("x"))
    if jax.default_backend() == "gpu":
        timer, time_ms = "events", CudaEvents().times_ms
    else:  # a CPU dry run (interpret mode): no CUDA events to record
        timer, time_ms = "host clock", lambda fn, inputs, repeats: [wall_median_ms(fn, inputs, repeats)]
    sets = [bench_kda.random_inputs(seed, *shape, True)[0] for seed in range(3)]
    check = bench_kda.numpy_inputs(7, 1, FLAGS.verify_len, shape[2], shape[3], True)
    check_args, do = bench_kda._device_inputs(check, 7)
    ref = bench_kda.reference_outputs(check, np.asarray(do, np.float32))
    ref = {n: ref[n] for n in ("o", "state")}
    print(f"bounded inference forward, {jax.devices()[0].device_kind}, B x T x H x D = {FLAGS.shape}, timed by "
          f"{timer}")
    for name in variants(FLAGS.ablations):
        jax.clear_caches()  # the kernels are traced again under this variant's patch
        tuning = Tuning.from_string(name[2:]) if name.startswith("t:") else Tuning()
        with patched("base" if name.startswith("t:") else name):
            forward, _, checked = bench_kda._jax_fns("pallas", True, tuning)
            ratio, errs = bench_kda.error_ratio(ref, dict(zip(("o", "state"), checked(*check_args))))
            start = time.perf_counter()
            jax.block_until_ready(forward(*sets[0]))
            compile_s = time.perf_counter() - start
            times = time_ms(forward, sets, FLAGS.timed_calls)
        print(f"{name:24s} fwd {np.median(times):.3f} ms (min {min(times):.3f})  max err/bar {ratio:.3f}  "
              f"o {errs['o']:.2e}  first call {compile_s:.0f} s", flush=True)


if __name__ == "__main__":
    app.run(main)
