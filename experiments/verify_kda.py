"""Checks chunk_kda(backend="pallas") on a GPU against the token-by-token fp32 reference, forward and backward.

  python -m experiments.verify_kda --out=benchmarks/results/kda_verify_h200.txt

Bars (DESIGN 5): relative RMS error < 0.005 for o and the final state, < 0.008 for dq, dk, dv (and the initial
state's gradient), < 0.02 for dg and dbeta with bf16 inputs; 1e-4 for everything with fp32 inputs. Also: outputs are
finite for gates saturated at g_min, and causal bitwise (changing tokens after t never changes o up to t).
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.kda import chunk_kda, relative_rms_error
from pallas_kernels.kda.testing import random_inputs

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "Also write the report to this file.")
flags.DEFINE_integer("dim", 128, "K = V.")
flags.DEFINE_string("backend", "pallas", "chunk_kda backend under test ('interpret' runs the same kernels on a CPU).")
flags.DEFINE_string("tuning", "base", "Launch tuning of the GPU kernels (backend pallas or interpret), as bench_kda's "
                    "--tuning: 'base' or 'field=value,...' of pallas_fwd.Tuning.")

G_MIN = -5.0
# o and state of the training forward (under jax.vjp), its gradients, then o and state of the forward alone (o_inf,
# state_inf: the inference forward, which the GPU runs as other kernels, see Tuning.output_from_scores).
NAMES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate0", "o_inf", "state_inf")
BF16_BARS = dict(o=0.005, state=0.005, dq=0.008, dk=0.008, dv=0.008, dg=0.02, dbeta=0.02, dstate0=0.008, o_inf=0.005,
                 state_inf=0.005)
# (name, gate distribution, dtype), all at one shape: each new shape costs about a minute of kernel compilation on
# the GPU. Other lengths (63, 64, 500, ...) are covered by the interpret-mode tests on the CPU.
SHAPE = dict(batch=1, seq_len=1000, heads=2, value_heads=4)
CASES = (
    ("T1000 gva seg layer", "layer", jnp.bfloat16),
    ("T1000 gva seg wide", "wide", jnp.bfloat16),
    ("T1000 gva seg satur.", "saturated", jnp.bfloat16),
    ("T1000 gva seg fp32", "wide", jnp.float32),
)


def make_inputs(seed, batch, seq_len, heads, value_heads, gate, bounded, dtype):
    """gate: "layer" (the layer's gate at initialisation), "wide" (g = g_min sigmoid(N) or -softplus(N): large decays),
    "saturated" (g = g_min everywhere; bounded only: unbounded uses -softplus(N) * 30, steep decays)."""
    x = random_inputs(seed, batch=batch, seq_len=seq_len, heads=heads, value_heads=value_heads, key_dim=FLAGS.dim,
                      value_dim=FLAGS.dim, gate="bounded" if bounded else "softplus", g_min=G_MIN, dtype=dtype)
    raw = jnp.asarray(np.random.default_rng(seed + 9).standard_normal(x["g"].shape, np.float32))
    if gate == "wide":
        x["g"] = G_MIN * jax.nn.sigmoid(raw) if bounded else -jax.nn.softplus(raw)
    elif gate == "saturated":
        x["g"] = jnp.full_like(x["g"], G_MIN) if bounded else -30 * jax.nn.softplus(raw)
    return x


def segments(batch, seq_len):
    """Documents of uneven length, one boundary inside a chunk and one on a chunk edge."""
    t = np.arange(seq_len)
    ids = (t >= seq_len // 3).astype(np.int32) + (t >= 128) + (t >= seq_len - 37)
    return jnp.asarray(np.broadcast_to(ids, (batch, seq_len)))


def run(backend, x, segment_ids, g_min, cotangents):
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
    if backend == "reference":  # the oracle computes in fp32 from the same (rounded) inputs
        args = [a.astype(jnp.float32) for a in args]

    def f(q, k, v, g, beta, s0):
        return chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, g_min=g_min,
                         backend=backend, segment_ids=segment_ids)

    (o, state), vjp = jax.vjp(f, *args)
    grads = vjp(tuple(c.astype(a.dtype) for c, a in zip(cotangents, (o, state))))
    inference = (o, state) if backend == "reference" else jax.jit(f)(*args)  # the oracle has one forward
    return [np.asarray(jnp.asarray(a, jnp.float32)) for a in (o, state, *grads, *inference)]


def check_case(case, bounded, seed):
    name, gate, dtype = case
    batch, seq_len = SHAPE["batch"], SHAPE["seq_len"]
    x = make_inputs(seed, batch, seq_len, SHAPE["heads"], SHAPE["value_heads"], gate, bounded, dtype)
    segment_ids = segments(batch, seq_len)
    rng = np.random.default_rng(seed + 1)
    cotangents = tuple(jnp.asarray(rng.standard_normal(x[n].shape, np.float32)) for n in ("v", "initial_state"))
    g_min = G_MIN if bounded else None
    ref = run("reference", x, segment_ids, g_min, cotangents)
    out = run(FLAGS.backend, x, segment_ids, g_min, cotangents)
    errs = {n: relative_rms_error(r, o) for n, r, o in zip(NAMES, ref, out)}
    finite = all(np.isfinite(o).all() for o in out)
    bars = BF16_BARS if dtype == jnp.bfloat16 else {n: 1e-4 for n in NAMES}
    ok = finite and all(errs[n] < bars[n] for n in NAMES)
    return ok, errs, finite


def check_causality(bounded, seed, cut=400):
    """o[:, :cut+1] must not change, bit for bit, when every input after token `cut` changes."""
    shape = (SHAPE["batch"], SHAPE["seq_len"], SHAPE["heads"], SHAPE["value_heads"])
    x = make_inputs(seed, *shape, "wide", bounded, jnp.bfloat16)
    y = make_inputs(seed + 5, *shape, "wide", bounded, jnp.bfloat16)
    mixed = {n: (jnp.concatenate([x[n][:, :cut + 1], y[n][:, cut + 1:]], axis=1) if n != "initial_state" else x[n])
             for n in x}
    g_min = G_MIN if bounded else None

    def o_of(inputs):
        args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
        return np.asarray(chunk_kda(*args, initial_state=inputs["initial_state"], g_min=g_min,
                                    backend=FLAGS.backend)[0][:, :cut + 1])

    return bool(np.array_equal(o_of(x), o_of(mixed)))


def tuned_backend(backend, text):
    """The backend under test: `backend` itself, or (a tuning other than the defaults) the GPU kernels with it,
    registered under a new name."""
    if text.strip() in ("", "base"):
        return backend
    if backend not in ("pallas", "interpret"):
        raise ValueError(f"--tuning applies to backend pallas or interpret, got --backend={backend!r}")
    import functools

    from pallas_kernels.kda import api
    from pallas_kernels.kda.pallas_fwd import Tuning
    from pallas_kernels.kda.pallas_op import kda_pallas
    kernel = functools.partial(kda_pallas, interpret=backend == "interpret", tuning=Tuning.from_string(text))
    name = f"{backend}[{text}]"
    api.BACKENDS[name] = api._whole_chunks(jax.jit(kernel, static_argnames=api._KERNEL_STATIC))
    return name


def main(argv):
    del argv
    FLAGS.backend = tuned_backend(FLAGS.backend, FLAGS.tuning)
    device = jax.devices()[0].device_kind
    lines = [f"chunk_kda(backend={FLAGS.backend!r}) vs the token-by-token fp32 reference on {device}, "
             f"jax {jax.__version__}, K = V = {FLAGS.dim}, B = 1, T = 1000 (padded to 1024 inside), H = 2, HV = 4 "
             "(grouped values), random initial state, 4 documents (one boundary inside a chunk), chunk 64. "
             "Gates: layer = the layer's gate at initialisation, wide = g_min sigmoid(N) or -softplus(N), "
             "satur. = g = g_min everywhere (bounded) or -30 softplus(N) (unbounded). Relative RMS errors; bars: "
             "bf16 o/state 5e-3, dq/dk/dv/dstate0 8e-3, dg/dbeta 2e-2; fp32 1e-4. o, state: the training forward "
             "(under jax.vjp); o_inf, state_inf: the forward alone (the inference kernels).", ""]
    header = f"{'gate':<10}{'case':<22}" + "".join(f"{n:>10}" for n in NAMES) + "  finite  result"
    lines.append(header)
    print("\n".join(lines), flush=True)
    all_ok = True
    for bounded in (True, False):
        gate = "bounded" if bounded else "unbounded"
        for i, case in enumerate(CASES):
            if case[2] == jnp.float32 and not bounded:
                continue  # one fp32 run (another minute of compiling) is enough: the kernels do not depend on the gate
            ok, errs, finite = check_case(case, bounded, 10 * i + bounded)
            all_ok &= ok
            line = f"{gate:<10}{case[0]:<22}" + "".join(f"{errs[n]:>10.2e}" for n in NAMES)
            lines.append(line + f"  {str(finite):<6}  {'PASS' if ok else 'FAIL'}")
            print(lines[-1], flush=True)
            save(lines)
        causal = check_causality(bounded, 100 + bounded)
        all_ok &= causal
        lines.append(f"{gate:<10}causality (T=1000, inputs after t=400 changed): o[:401] bitwise equal: {causal}")
        print(lines[-1], flush=True)
    lines.append(f"ALL {'PASS' if all_ok else 'FAIL'}")
    print(lines[-1], flush=True)
    save(lines)


def save(lines):
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    app.run(main)
