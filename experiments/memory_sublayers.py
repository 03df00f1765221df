"""Compiled temporaries per token of each sublayer's forward+backward, and of the whole step (no run).

    python -m experiments.memory_sublayers --gin_file=configs/small_h200.gin --lengths=16384,65536 \
        [--model_lengths=65536] [--out=benchmarks/results/memory_h200]

Nothing is executed: every figure is XLA's `memory_analysis().temp_size_in_bytes` of a compiled program,
so lengths that would not fit still report what they would ask for. Per length, for KDA, MLA (with and
without segment ids: cuDNN's packed path keeps a workspace per segment slot) and MoE: one sublayer on
[1, T, d] activations, with and without `jax.checkpoint`; then the whole LM loss step at --model_lengths.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
from absl import app, flags

flags.DEFINE_multi_string("gin_file", ["configs/small_h200.gin"], "Model config.")
flags.DEFINE_multi_string("gin_param", [], "Extra bindings.")
flags.DEFINE_list("lengths", ["16384", "65536"], "Sublayer lengths.")
flags.DEFINE_list("model_lengths", [], "Whole-step lengths (compiling the model takes minutes at 1M).")
flags.DEFINE_string("out", "", "Write OUT.json and OUT.md when set.")
FLAGS = flags.FLAGS


def _temp_kib_per_token(fn, t, *args) -> float:
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / t / 1024


def sublayer_rows(cfg, t: int) -> list[dict]:
    from hybridmoe.layers.common import dtype_of
    from hybridmoe.layers.kda import KDA
    from hybridmoe.layers.mla import MLA
    from hybridmoe.layers.moe import MoE

    dt = dtype_of(cfg.dtype)
    common = dict(d_model=cfg.d_model, dtype=dt, param_dtype=dtype_of(cfg.param_dtype), norm_eps=cfg.norm_eps)
    x = jax.ShapeDtypeStruct((1, t, cfg.d_model), dt)
    small = jnp.zeros((1, 256, cfg.d_model), dt)
    cases = [("kda", KDA(cfg.kda, **common), True), ("mla", MLA(cfg.mla, **common), True),
             ("mla", MLA(cfg.mla, **common), False), ("moe", MoE(cfg.moe, cfg.router, **common), None)]
    rows = []
    for name, module, with_segments in cases:
        extra = () if with_segments is None else (jnp.zeros((1, 256), jnp.int32) if with_segments else None,)
        variables = jax.eval_shape(module.init, jax.random.PRNGKey(0), small, *extra)
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        for remat in (False, True):
            def loss(p, rest, x):
                segs = () if with_segments is None else (
                    jnp.zeros(x.shape[:2], jnp.int32) if with_segments else None,)

                def f(p, x):
                    out = module.apply({"params": p, **rest}, x, *segs, mutable=list(rest))[0]
                    return out[0] if isinstance(out, tuple) else out
                out = (jax.checkpoint(f) if remat else f)(p, x)
                return jnp.mean(out.astype(jnp.float32) ** 2)
            row = {"T": t, "part": name, "segments": with_segments, "remat": remat}
            try:
                row["temp_kib_per_token"] = _temp_kib_per_token(jax.grad(loss, argnums=(0, 2)), t, params, rest, x)
            except Exception as e:  # noqa: BLE001 - reported in the row
                row["error"] = str(e).splitlines()[0][:200]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def model_row(cfg, t: int) -> dict:
    from hybridmoe.model import build_model
    from hybridmoe.train.step import cross_entropy

    model = build_model(cfg)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 128), jnp.int32))
    tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(params, router, tokens):
        (logits, aux), _ = model.apply({"params": params, "router": router}, tokens,
                                       segment_ids=jnp.zeros_like(tokens), mutable=["router"])
        return cross_entropy(logits, tokens, jnp.ones(tokens.shape, jnp.float32))[0] + aux["aux_loss"]
    start = time.perf_counter()
    kib = _temp_kib_per_token(jax.value_and_grad(loss), t, variables["params"], variables["router"], tokens)
    row = {"T": t, "part": "model step", "temp_kib_per_token": kib, "temp_gib": kib * t / 2**20,
           "compile_s": time.perf_counter() - start}
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"# Compiled temporaries per token ({device}, jax {jax.__version__})", "",
             "| T | part | segment ids | remat | temp KiB/token | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        seg = "-" if r.get("segments") is None else ("yes" if r["segments"] else "no")
        value = f"{r['temp_kib_per_token']:.1f}" if "temp_kib_per_token" in r else "failed"
        note = r.get("error", f"{r['temp_gib']:.1f} GiB in all" if "temp_gib" in r else "")
        lines.append(f"| {r['T']} | {r['part']} | {seg} | {r.get('remat', '-')} | {value} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    from hybridmoe import load_config
    cfg = load_config(FLAGS.gin_file, FLAGS.gin_param).model
    rows = []
    for t in map(int, FLAGS.lengths):
        rows += sublayer_rows(cfg, t)
    for t in map(int, FLAGS.model_lengths):
        rows.append(model_row(cfg, t))
    device = jax.devices()[0].device_kind
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out + ".json", "w", encoding="utf-8") as f:
            json.dump({"device": device, "gin_file": FLAGS.gin_file, "gin_param": FLAGS.gin_param,
                       "rows": rows}, f, indent=1)
        with open(FLAGS.out + ".md", "w", encoding="utf-8") as f:
            f.write(markdown(rows, device))
    print(markdown(rows, device))


if __name__ == "__main__":
    app.run(main)
