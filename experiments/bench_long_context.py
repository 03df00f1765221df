"""Forward+backward of a whole model at long context on one accelerator, split by layer type.

    python -m experiments.bench_long_context --gin_file=configs/small_h200.gin \
        --lengths=8192,65536,262144,1048576 --out=benchmarks/results/long_context_h200

Each length runs in its own process (clean peak-memory counter; an out-of-memory at one length does
not hide the others). Per length:
  * step_s: one jitted value_and_grad of the LM loss over one row of T tokens (the config's remat
    policy), median of --repeats after a warm-up call; peak_gib: the device's peak bytes in use;
  * kda_s / mla_s / moe_s: forward+backward of one isolated sublayer of each kind on [1, T, d]
    activations (no remat), times the number of such sublayers in the model. They need not add up to
    step_s (remat recomputes forwards; the head, norms and residuals are outside them).
The row is one document of T tokens (no packing): the long-context case itself.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

flags.DEFINE_multi_string("gin_file", ["configs/small_h200.gin"], "Model config.")
flags.DEFINE_multi_string("gin_param", [], "Extra bindings.")
flags.DEFINE_list("lengths", ["8192", "65536", "262144", "1048576"], "Sequence lengths.")
flags.DEFINE_integer("repeats", 3, "Timed repeats per measurement (median).")
flags.DEFINE_bool("split", True, "Also time isolated KDA / MLA / MoE sublayers.")
flags.DEFINE_string("out", "", "Write OUT.json and OUT.md (rows of every length) when set.")
flags.DEFINE_integer("warm_up_below", 262144, "Lengths below this get an untimed warm-up call.")
flags.DEFINE_bool("merge", False, "Keep OUT.json's rows of lengths not measured in this run.")
flags.DEFINE_integer("timeout_s", 0, "Stop a length after this many seconds, keeping what it measured (0: none).")
flags.DEFINE_integer("child_len", 0, "Internal: measure this one length and print its row.")
FLAGS = flags.FLAGS

ROW_PREFIX = "ROW "


def _compiled(fn, *args):
    """fn compiled ahead of time for args, and the seconds compiling took."""
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - start


def _median_s(fn, *args) -> float:
    """Median seconds of compiled fn over --repeats calls, after one untimed call below
    --warm_up_below tokens (above, one call takes seconds to minutes and nothing is left to warm)."""
    if FLAGS.child_len < FLAGS.warm_up_below:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sublayer_s(module, x, *extra) -> float:
    """Median seconds of forward+backward (w.r.t. params and input) of one module on x."""
    variables = jax.jit(module.init)(jax.random.PRNGKey(0), x, *extra)
    params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}

    def loss(p, x):
        out = module.apply({"params": p, **rest}, x, *extra, mutable=list(rest))[0]
        out = out[0] if isinstance(out, tuple) else out
        return jnp.mean(out.astype(jnp.float32) ** 2)

    return _median_s(_compiled(jax.jit(jax.grad(loss, argnums=(0, 1))), params, x)[0], params, x)


def measure(t: int) -> dict:
    from hybridmoe import load_config
    from hybridmoe.layers.common import dtype_of
    from hybridmoe.layers.kda import KDA
    from hybridmoe.layers.mla import MLA
    from hybridmoe.layers.moe import MoE
    from hybridmoe.model import build_model
    from hybridmoe.train.step import cross_entropy

    cfg = load_config(FLAGS.gin_file, FLAGS.gin_param).model
    model = build_model(cfg)
    rng = np.random.default_rng(t)
    tokens = jnp.asarray(rng.integers(0, 256, size=(1, t + 1)), jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    segments = jnp.zeros_like(inputs)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), inputs[:, :128])

    def loss(params):
        (logits, aux), _ = model.apply({"params": params, "router": variables["router"]}, inputs,
                                       segment_ids=segments, mutable=["router"])
        return cross_entropy(logits, targets, jnp.ones_like(targets, jnp.float32))[0] + aux["aux_loss"]

    row = {"T": t, "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    try:  # a step that does not fit must not lose the sublayer times below
        step, compile_s = _compiled(jax.jit(jax.value_and_grad(loss)), variables["params"])
        step_s = _median_s(step, variables["params"])
        del step
        row.update(step_s=step_s, compile_s=compile_s, tokens_per_s=t / step_s)
        logging.info("T=%d step %.3f s", t, step_s)
    except Exception as e:  # noqa: BLE001 - reported in the row
        row["step_error"] = str(e).splitlines()[0][:300]
        logging.warning("T=%d step failed: %s", t, row["step_error"])
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_gib"] = stats.get("peak_bytes_in_use", float("nan")) / 2**30
    _emit(row)  # a 1M step takes minutes: what is measured so far survives a timeout
    del variables
    if FLAGS.split:
        dt = dtype_of(cfg.dtype)
        common = dict(d_model=cfg.d_model, dtype=dt, param_dtype=dtype_of(cfg.param_dtype),
                      norm_eps=cfg.norm_eps)
        x = jnp.asarray(rng.standard_normal((1, t, cfg.d_model)), dt)
        kinds = cfg.layer_kinds
        n_moe = len(kinds) - cfg.moe.first_k_dense
        parts = {"kda_s": (kinds.count("K"), KDA(cfg.kda, **common), (x, segments)),
                 "mla_s": (kinds.count("M"), MLA(cfg.mla, **common), (x, segments)),
                 "moe_s": (n_moe, MoE(cfg.moe, cfg.router, **common), (x,))}
        for key, (count, module, args) in parts.items():
            try:  # one sublayer out of memory must not lose the step time measured above
                row[key] = count * _sublayer_s(module, *args)
                _emit(row)
            except Exception as e:  # noqa: BLE001 - reported in the row
                row[key + "_error"] = str(e).splitlines()[0][:200]
                logging.warning("T=%d %s failed: %s", t, key, row[key + "_error"])
        if "kda_s" in row:
            row["kda_us_per_token"] = row["kda_s"] / t * 1e6
    return row


def _emit(row: dict) -> None:
    """Prints the row measured so far; the parent keeps the last one a child printed."""
    print(ROW_PREFIX + json.dumps(row), flush=True)


def _run_child(t: int) -> dict:
    argv = [sys.executable, "-m", "experiments.bench_long_context", f"--child_len={t}",
            f"--repeats={FLAGS.repeats}", f"--split={FLAGS.split}", f"--warm_up_below={FLAGS.warm_up_below}"]
    argv += [f"--gin_file={g}" for g in FLAGS.gin_file] + [f"--gin_param={p}" for p in FLAGS.gin_param]
    # The parent never touches the device; each child may take nearly all of its memory.
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=FLAGS.timeout_s or None)
        stdout, stderr, timed_out = proc.stdout, proc.stderr, False
    except subprocess.TimeoutExpired as e:
        as_text = lambda b: b.decode() if isinstance(b, bytes) else (b or "")  # noqa: E731
        stdout, stderr, timed_out = as_text(e.stdout), as_text(e.stderr), True
    rows = [json.loads(line[len(ROW_PREFIX):]) for line in stdout.splitlines() if line.startswith(ROW_PREFIX)]
    if rows:
        return {**rows[-1], "timed_out": True} if timed_out else rows[-1]
    tail = stderr.strip().splitlines()[-5:]
    return {"T": t, "error": (f"no row within --timeout_s={FLAGS.timeout_s} | " if timed_out else "")
            + " | ".join(tail)}


def _cell(row: dict, key: str) -> str:
    if key in row:
        return f"{row[key]:.3f}"
    return "failed" if key + "_error" in row else "-"


def write_tables(rows: list[dict], out: str) -> None:
    meta = {"gin_file": FLAGS.gin_file, "gin_param": FLAGS.gin_param,
            "repeats": FLAGS.repeats, "rows_are": "one row of T tokens, one document"}
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(markdown_table(rows))


def markdown_table(rows: list[dict]) -> str:
    """One line per length; a failed length shows its error's last line."""
    lines = ["| T | step s | tokens/s | KDA s | MLA s | MoE s | KDA us/token | peak GiB | compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['T']} | failed: {r['error'].split(' | ')[-1][:160]} |||||||")
            continue
        step = [f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}"] if "step_s" in r else ["failed", "-"]
        cells = [r["T"], *step, _cell(r, "kda_s"), _cell(r, "mla_s"), _cell(r, "moe_s"),
                 _cell(r, "kda_us_per_token"), f"{r['peak_gib']:.1f}",
                 f"{r['compile_s']:.0f}" if "compile_s" in r else "-"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    errors = [f"- T = {r['T']}: the step failed: {r['step_error']}" for r in rows if "step_error" in r]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def main(argv):
    del argv
    if FLAGS.child_len:
        _emit(measure(FLAGS.child_len))
        return
    lengths = list(map(int, FLAGS.lengths))
    kept = []
    if FLAGS.merge and FLAGS.out and os.path.exists(FLAGS.out + ".json"):
        with open(FLAGS.out + ".json", encoding="utf-8") as f:
            kept = [r for r in json.load(f)["rows"] if r["T"] not in lengths]
    rows = []
    for t in lengths:
        rows.append(_run_child(t))
        print(json.dumps(rows[-1]), flush=True)
        if FLAGS.out:
            os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
            write_tables(sorted(kept + rows, key=lambda r: r["T"]), FLAGS.out)


if __name__ == "__main__":
    app.run(main)
