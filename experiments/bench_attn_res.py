"""Step time and compiled memory of the residual modes (DESIGN §3.4), side by side in one run.

Variants: mode none / block / full, each with and without remat. One jitted value_and_grad of the
LM loss per variant; timing rounds are interleaved (one step of every variant per round, the order
rotating) so machine noise hits all variants alike. Memory is XLA's compiled estimate:
temp + argument bytes of the whole step. Results are ratios to mode none with the same remat.

    PYTHONPATH=. python -m experiments.bench_attn_res            # CPU: attn_res_cpu.{json,md,png}
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from hybridmoe import build_model
from hybridmoe import config as C

flags.DEFINE_integer("num_layers", 16, "Layers of the model.")
flags.DEFINE_integer("d_model", 128, "Model width.")
flags.DEFINE_integer("block_size", 4, "Layers per block in mode block.")
flags.DEFINE_integer("heads", 2, "KDA and MLA heads (KDA head dim 64, MLA 32+16/32).")
flags.DEFINE_string("kda_backend", "auto", "KDAConfig.backend (auto: the Pallas kernels on GPU).")
flags.DEFINE_integer("batch", 2, "Sequences per step.")
flags.DEFINE_integer("seq_len", 256, "Tokens per sequence.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Activation dtype.")
flags.DEFINE_list("remats", ["none", "full"], "Remat settings to compare (ModelConfig.remat).")
flags.DEFINE_list("modes", ["none", "block", "full"], "Residual modes to compare (the first is the baseline).")
flags.DEFINE_integer("experts", 8, "Routed experts (top-2, one shared expert, width 2·d_model).")
flags.DEFINE_integer("warmup", 2, "Untimed steps per variant after compiling.")
flags.DEFINE_integer("rounds", 30, "Timed rounds; each times one step of every variant.")
flags.DEFINE_string("out_dir", "benchmarks/results", "Where the results go.")
flags.DEFINE_string("tag", "", "Result file suffix; default: the JAX backend (cpu, gpu).")
FLAGS = flags.FLAGS

MODES = ("none", "block", "full")


def _check_flags():
    bad = [m for m in FLAGS.modes if m not in MODES]
    if bad or "none" not in FLAGS.modes:
        raise app.UsageError(f"--modes={','.join(FLAGS.modes)}: must include 'none' (the baseline) "
                             f"and only use {', '.join(MODES)}")


def model_config(mode: str, remat: str) -> C.ModelConfig:
    return C.ModelConfig(
        d_model=FLAGS.d_model, num_layers=FLAGS.num_layers, layer_pattern="KKKM",
        dtype=FLAGS.dtype, remat=remat,
        kda=C.KDAConfig(num_heads=FLAGS.heads, head_dim=64, chunk_size=64, backend=FLAGS.kda_backend),
        mla=C.MLAConfig(num_heads=FLAGS.heads, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                        v_head_dim=32),
        moe=C.MoEConfig(num_experts=FLAGS.experts, top_k=2, num_shared_experts=1,
                        expert_width=2 * FLAGS.d_model),
        attn_res=C.AttnResConfig(mode=mode, block_size=FLAGS.block_size),
    )


def make_step(cfg: C.ModelConfig):
    """(params, router, tokens [B, T]) -> (loss, grads): next-token cross-entropy + MoE aux loss."""
    model = build_model(cfg)

    def loss_fn(params, router, tokens):
        logits, aux = model.apply({"params": params, "router": router}, tokens)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
        return jnp.mean(nll) + aux["aux_loss"]

    return jax.jit(jax.value_and_grad(loss_fn))


def init_variables(tokens: jax.Array) -> dict:
    """Initialised once, in mode full: block uses the same sites, mode none none of them."""
    model = build_model(model_config("full", "none"))
    return nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens))


def build_variant(mode: str, remat: str, tokens: jax.Array, variables: dict) -> dict:
    cfg = model_config(mode, remat)
    step = make_step(cfg)
    params = {k: v for k, v in variables["params"].items()
              if mode != "none" or not k.startswith("attn_res_")}
    router = variables["router"]
    t0 = time.perf_counter()
    compiled = step.lower(params, router, tokens).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    logging.info("%s/remat=%s compiled in %.1f s", mode, remat, compile_s)
    return {
        "name": f"{mode}/remat={remat}", "mode": mode, "remat": remat, "step": compiled,
        "args": (params, router, tokens), "compile_s": compile_s,
        "param_count": int(sum(np.prod(p.shape) for p in jax.tree.leaves(params))),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes), "times": [], "cpu_times": [],
    }


def verify(variants: list[dict]) -> dict:
    """Before timing: finite losses; remat changes nothing but the schedule (same loss, grads)."""
    out = {}
    by_name = {v["name"]: v for v in variants}
    for v in variants:
        loss, grads = v["step"](*v["args"])
        v["loss"] = float(loss)
        assert np.isfinite(v["loss"]), v["name"]
    # Remat changes the schedule, not the function: same loss and gradients up to rounding (fp32:
    # 1e-4 of the largest gradient; bf16 recomputation rounds differently, 5e-2).
    tol = 1e-4 if FLAGS.dtype == "float32" else 5e-2
    for mode in FLAGS.modes:
        if len(FLAGS.remats) < 2:
            out[mode] = {"loss": by_name[f"{mode}/remat={FLAGS.remats[0]}"]["loss"]}
            continue
        a, b = by_name[f"{mode}/remat=none"], by_name[f"{mode}/remat=full"]
        (la, ga), (lb, gb) = a["step"](*a["args"]), b["step"](*b["args"])
        scale = max(float(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in jax.tree.leaves(ga))
        err = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
                  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb))) / scale
        out[mode] = {"loss": float(la), "loss_remat_diff": abs(float(la) - float(lb)),
                     "grad_remat_max_rel_diff": err}
        assert abs(float(la) - float(lb)) < 10 * tol and err < tol, (mode, out[mode])
    return out


def time_interleaved(variants: list[dict]) -> None:
    for v in variants:
        for _ in range(FLAGS.warmup):
            jax.block_until_ready(v["step"](*v["args"]))
    n = len(variants)
    for r in range(FLAGS.rounds):
        for k in range(n):
            v = variants[(k + r) % n]  # rotate the order so no variant always runs first
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(v["step"](*v["args"]))
            v["times"].append(time.perf_counter() - t0)
            v["cpu_times"].append(time.process_time() - c0)


def summarise(variants: list[dict], checks: dict) -> dict:
    rows = []
    for v in variants:
        base = next(u for u in variants if u["mode"] == "none" and u["remat"] == v["remat"])
        median, base_median = statistics.median(v["times"]), statistics.median(base["times"])
        # Rounds are interleaved, so a per-round ratio compares steps that met the same load.
        ratios = [a / b for a, b in zip(v["times"], base["times"])]
        per_round = statistics.median(ratios)
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        # CPU time of this process (all its threads): work done, not time spent waiting for the
        # cores other jobs hold on a shared machine.
        cpu, base_cpu = statistics.median(v["cpu_times"]), statistics.median(base["cpu_times"])
        mem = v["temp_bytes"] + v["argument_bytes"]
        base_mem = base["temp_bytes"] + base["argument_bytes"]
        rows.append({
            "variant": v["name"], "mode": v["mode"], "remat": v["remat"],
            "median_step_ms": 1e3 * median, "step_times_ms": [1e3 * t for t in v["times"]],
            "step_ratio_to_none": median / base_median, "median_per_round_ratio_to_none": per_round,
            "per_round_ratio_quartiles": [q1, q3],
            "min_step_ratio_to_none": min(v["times"]) / min(base["times"]),
            "median_cpu_ms": 1e3 * cpu, "cpu_times_ms": [1e3 * t for t in v["cpu_times"]],
            "cpu_ratio_to_none": cpu / base_cpu,
            "temp_bytes": v["temp_bytes"], "argument_bytes": v["argument_bytes"],
            "output_bytes": v["output_bytes"], "memory_bytes": mem,
            "memory_ratio_to_none": mem / base_mem,
            "compile_s": v["compile_s"], "param_count": v["param_count"], "loss": v["loss"],
        })
    return {
        "benchmark": "attn_res residual modes: jitted value_and_grad of the LM loss",
        "jax_version": jax.__version__, "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()], "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "shapes": {"num_layers": FLAGS.num_layers, "d_model": FLAGS.d_model, "batch": FLAGS.batch,
                   "seq_len": FLAGS.seq_len, "block_size": FLAGS.block_size, "dtype": FLAGS.dtype,
                   "layer_pattern": "KKKM"},
        "model_config": dataclasses.asdict(model_config("block", "none")),
        "timing": {"warmup": FLAGS.warmup, "rounds": FLAGS.rounds, "interleaved": True,
                   "load_average_after": os.getloadavg(),
                   "statistic": "median wall time per step; step_ratio_to_none is the ratio of "
                                "medians, median_per_round_ratio_to_none the median of the ratios "
                                "within each round"},
        "memory": "compiled memory_analysis(): temp + argument bytes",
        "verify": checks, "results": rows,
    }


def write_markdown(summary: dict, path: str) -> None:
    s = summary["shapes"]
    lines = [
        f"# AttnRes residual modes, {summary['backend']} ({summary['jax_version']})", "",
        f"{s['num_layers']} layers, d={s['d_model']}, batch {s['batch']} × {s['seq_len']} tokens, "
        f"{s['dtype']}, block size {s['block_size']}, pattern {s['layer_pattern']}. "
        f"Median of {summary['timing']['rounds']} interleaved steps; "
        "memory = compiled temp + argument bytes.",
        "Ratios are to mode none with the same remat setting. Step / none: ratio of the median "
        "wall times; per round: median of the ratios within each round; min / min: ratio of the "
        "fastest steps; CPU time / none: ratio of the median process CPU times (all threads): "
        "work done rather than time waited for cores other jobs hold.",
        "",
        "| variant | step ms | step / none | per round (quartiles) | min / min | CPU time / none "
        "| memory MiB | memory / none | compile s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["results"]:
        q = r["per_round_ratio_quartiles"]
        lines.append(
            f"| {r['variant']} | {r['median_step_ms']:.1f} | {r['step_ratio_to_none']:.3f} | "
            f"{r['median_per_round_ratio_to_none']:.3f} ({q[0]:.2f}–{q[1]:.2f}) | "
            f"{r['min_step_ratio_to_none']:.3f} | {r['cpu_ratio_to_none']:.3f} | "
            f"{r['memory_bytes'] / 2**20:.1f} | "
            f"{r['memory_ratio_to_none']:.3f} | {r['compile_s']:.1f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["results"]
    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, title in ((axes[0], "step_ratio_to_none", "step time / none"),
                           (axes[1], "memory_ratio_to_none", "memory / none")):
        ax.bar(range(len(rows)), [r[key] for r in rows],
               color=["C0" if r["remat"] == "none" else "C1" for r in rows])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
    axes[0].axhline(1.1, color="r", lw=0.8, ls="--")
    fig.suptitle(f"AttnRes modes, {summary['backend']}: {summary['shapes']['num_layers']} layers, "
                 f"d={summary['shapes']['d_model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    del argv
    _check_flags()
    tokens = jax.random.randint(jax.random.key(1), (FLAGS.batch, FLAGS.seq_len), 0, 259)
    variables = init_variables(tokens)
    variants = [build_variant(m, r, tokens, variables) for r in FLAGS.remats for m in FLAGS.modes]
    checks = verify(variants)
    logging.info("verified: %s", checks)
    time_interleaved(variants)
    summary = summarise(variants, checks)
    tag = FLAGS.tag or jax.default_backend()
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    stem = os.path.join(FLAGS.out_dir, f"attn_res_{tag}")
    with open(stem + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    write_markdown(summary, stem + ".md")
    write_plot(summary, stem + ".png")
    print(open(stem + ".md").read())


if __name__ == "__main__":
    app.run(main)
