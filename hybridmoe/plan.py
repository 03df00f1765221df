"""Planning a run before it runs (DESIGN §3.7): parameters, FLOPs, per-device memory, and whether it lowers.

Nothing here allocates model-sized arrays: counts are analytic (and cross-checked against
`jax.eval_shape(model.init)`), per-device bytes come from the shardings the logical rules give each
parameter and optimizer leaf on the planned mesh, and lowering traces the real train step on abstract
arrays (`jax.ShapeDtypeStruct` with shardings) over a mesh of fake CPU devices or an `AbstractMesh`.

Conventions:
  total_params   every parameter (embedding and output head included).
  active_params  parameters one token uses: all but the routed experts, plus top_k/E of those; the output
                 head counts (a matmul per token), the embedding table does not (a row lookup). The same
                 count with the embedding is `active_params_with_embedding`.
  activations    an estimate of what the backward pass keeps per device for one microbatch (see
                 `activation_bytes`), not a measurement.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe import sharding
from hybridmoe.config import ExperimentConfig, MeshConfig, ModelConfig
from hybridmoe.model import build_model
from hybridmoe.train.optimizer import make_optimizer
from hybridmoe.train.step import init_train_state, jit_train_step, model_flops_per_token

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


# ------------------------------------------------------------------------------------- parameter counts

def _kda_params(cfg: ModelConfig) -> int:
    k, d = cfg.kda, cfg.d_model
    h, hv, dk, dv = k.num_heads, k.value_heads, k.head_dim, k.value_dim
    qkv = 2 * h * dk + hv * dv
    return (d * qkv + k.conv_width * qkv  # projections and their short convolutions
            + d * dk + dk * hv * dk + hv + hv * dk  # forget gate: low rank, A_log, dt_bias
            + d * hv + dv + d * hv * dv + hv * dv * d)  # beta, output norm, output gate, W_o


def _mla_params(cfg: ModelConfig) -> int:
    m, d = cfg.mla, cfg.d_model
    dqk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = (d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.num_heads * dqk if m.q_lora_rank
         else d * m.num_heads * dqk)
    kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
        + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + (1 + m.output_gate) * m.num_heads * m.v_head_dim * d


def _moe_params(cfg: ModelConfig) -> dict[str, int]:
    m, d = cfg.moe, cfg.d_model
    width_in = m.latent_dim or d
    latent = 2 * d * m.latent_dim + m.latent_dim if m.latent_dim else 0
    return {"routed": m.num_experts * 3 * width_in * m.expert_width,
            "always": d * m.num_experts + latent + 3 * d * m.num_shared_experts * m.expert_width}


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Analytic parameter counts of `HybridLM(cfg)`, by component, plus total and active."""
    d, kinds = cfg.d_model, cfg.layer_kinds
    moe = _moe_params(cfg)
    n_moe = len(kinds) - cfg.moe.first_k_dense
    # AttnRes: two sites per layer and a final one, but the first (only the embedding as source) has none.
    sites = 2 * len(kinds) if cfg.attn_res.mode != "none" else 0
    out = {
        "embedding": cfg.vocab_size * d,
        "head": 0 if cfg.tie_embeddings else d * cfg.vocab_size,
        "kda": kinds.count("K") * _kda_params(cfg),
        "mla": kinds.count("M") * _mla_params(cfg),
        "dense_ffn": cfg.moe.first_k_dense * 3 * d * cfg.moe.dense_width,
        "routed_experts": n_moe * moe["routed"],
        "moe_other": n_moe * moe["always"],  # router, latent projections, shared experts
        "norms_and_attn_res": (2 * len(kinds) + 1) * d + sites * 2 * d,
    }
    out["total"] = sum(out.values())
    routed_active = out["routed_experts"] * cfg.moe.top_k // cfg.moe.num_experts
    out["active"] = out["total"] - out["routed_experts"] + routed_active - out["embedding"]
    out["active_with_embedding"] = out["active"] + out["embedding"]
    return out


def abstract_params(cfg: ModelConfig, tokens_shape=(1, 16)) -> Any:
    """Boxed parameter shapes from `jax.eval_shape(model.init)`: traces the model, allocates nothing."""
    model = build_model(cfg)
    return jax.eval_shape(model.init, jax.random.key(0),
                          jax.ShapeDtypeStruct(tokens_shape, jnp.int32))["params"]


def count_abstract(boxed: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(boxed)))


# ------------------------------------------------------------------------------------------------- FLOPs

def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward matmul FLOPs per token (step.model_flops_per_token, the MFU numerator's basis), training
    model FLOPs (3× forward) and the hardware FLOPs with remat (attention forward recomputed)."""
    fwd = model_flops_per_token(cfg, seq_len)
    recompute = fwd["kda"] + fwd["mla"] if cfg.remat in ("full", "all") else 0.0
    if cfg.remat == "all":
        recompute += fwd["total"] - fwd["kda"] - fwd["mla"] - fwd.get("head", 0.0)
    return {"forward": fwd["total"], "train": 3 * fwd["total"],
            "train_with_remat": 3 * fwd["total"] + recompute,
            "forward_by_part": {k: v for k, v in fwd.items() if k != "total"}}


# ------------------------------------------------------------------------------------ per-device memory

def _leaf_bytes(x, spec, sizes: Mapping[str, int]) -> int:
    shard = 1
    entries = tuple(spec) + (None,) * (len(x.shape) - len(spec))
    for dim, entry in zip(x.shape, entries):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        shard *= dim // math.prod(sizes[a] for a in axes)
    return shard * np.dtype(x.dtype).itemsize


def tree_bytes(tree: Any, specs: Any, sizes: Mapping[str, int]) -> int:
    """Bytes one device holds of `tree` (shapes) laid out by `specs`."""
    leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    return sum(_leaf_bytes(x, s, sizes) for x, s in zip(jax.tree.leaves(tree), leaves))


def _split(n: int, size: int) -> float:
    return n / size if n % size == 0 else float(n)


def activation_bytes(cfg: ModelConfig, rows: int, seq_len: int, sizes: Mapping[str, int],
                     rules) -> float:
    """Estimate of the activations the backward pass keeps, per device, for `rows` × `seq_len` tokens.

    Per token and layer: the sublayer inputs and norms; for KDA its projections, convolutions, gates,
    per-chunk states and intra-chunk matrices; for MLA q/k/v and, with the "xla" backend, the [T, T]
    probabilities per head (fused backends keep only a log-sum-exp); for MoE the router scores, the
    capacity buffers [E, C, d] (C·E ≈ capacity_factor·k·tokens, or E·tokens for dropless under expert
    parallelism), the expert hiddens and the shared experts. remat="full" keeps only the attention inputs
    plus one layer's attention internals at a time; remat="all" does the same for the FFN sublayers. Widths split over `tensor` where they divide.
    """
    a = DTYPE_BYTES[cfg.dtype]
    tokens = _split(rows, math.prod(sizes[x] for x in sharding.mesh_axes("batch", rules))) \
        * _split(seq_len, math.prod(sizes[x] for x in sharding.mesh_axes("length", rules)))
    tp = math.prod(sizes[x] for x in sharding.mesh_axes("heads", rules))
    k, m, moe, d = cfg.kda, cfg.mla, cfg.moe, cfg.d_model
    h, hv, dk, dv = k.num_heads, k.value_heads, k.head_dim, k.value_dim
    kda = (2 * (2 * h * dk + hv * dv) * a + (2 * h * dk + 3 * hv * dk + hv) * 4
           + hv * dk * dv * 4 / k.chunk_size + 2 * hv * k.chunk_size * 4 + 4 * hv * dv * 4) / tp + dk * a
    dqk = m.qk_nope_head_dim + m.qk_rope_head_dim
    probs = m.num_heads * seq_len * 4 if m.backend == "xla" else m.num_heads * 4
    mla = (m.num_heads * (3 * dqk + 3 * m.v_head_dim) * a + probs) / tp \
        + (m.q_lora_rank + 2 * m.kv_lora_rank + m.qk_rope_head_dim) * a
    width_in = moe.latent_dim or d
    slots = moe.capacity_factor * moe.top_k if moe.dispatch == "capacity" else moe.num_experts
    routed = moe.num_experts * 4 + slots * (2 * width_in * a + 3 * moe.expert_width * a / tp) \
        + moe.top_k * width_in * 4 + 3 * moe.latent_dim * a
    shared = 3 * moe.num_shared_experts * moe.expert_width * a / tp
    dense = 3 * moe.dense_width * a / tp
    kinds = cfg.layer_kinds
    attn = [kda if kind == "K" else mla for kind in kinds]
    ffn = [dense if i < moe.first_k_dense else routed + shared for i in range(len(kinds))]
    sources = (len(kinds) // cfg.attn_res.block_size + 2) if cfg.attn_res.mode == "block" else 1
    per_token = 4 * d * a * len(kinds) + sources * d * a
    per_token += max(attn) if cfg.remat in ("full", "all") else sum(attn)
    per_token += max(ffn) if cfg.remat == "all" else sum(ffn)
    logits = 2 * _split(cfg.vocab_size, math.prod(sizes[x] for x in sharding.mesh_axes("vocab", rules))) * 4
    return tokens * (per_token + logits)


def memory_per_device(config: ExperimentConfig, mesh_cfg: MeshConfig, sizes: Mapping[str, int],
                      batch: int, seq_len: int, boxed: Any) -> dict[str, float]:
    """Bytes per device: params, optimizer state, gradients, activation estimate, and their sum."""
    rules = mesh_cfg.rules
    pspecs = sharding.param_specs(boxed, rules, sizes)
    params = nn.meta.unbox(boxed)
    opt_shapes = jax.eval_shape(make_optimizer(config.train, boxed).init, params)
    out = {"params": tree_bytes(params, pspecs, sizes),
           "optimizer": tree_bytes(opt_shapes, sharding.specs_like_params(opt_shapes, params, pspecs),
                                   sizes),
           "gradients": tree_bytes(params, pspecs, sizes),
           "activations": activation_bytes(config.model, batch // config.train.grad_accum, seq_len,
                                           sizes, rules)}
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------------------- lowering

def _abstract_tree(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def lower_train_step(config: ExperimentConfig, mesh, batch: int, seq_len: int):
    """Traces and lowers the sharded train step on abstract inputs over `mesh` (a Mesh of devices, fake
    or real, or an AbstractMesh). Returns the `Lowered` object; raises what lowering raises."""
    cfg = config.model
    micro = (batch // config.train.grad_accum, seq_len)
    sizes = sharding.axis_sizes(mesh)
    sharding.check_batch(micro, config.mesh.rules, sizes, "--batch / TrainConfig.grad_accum, --seq_len")
    model = build_model(cfg)
    example = jax.ShapeDtypeStruct(micro, jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.key(0), example)["params"]
    optimizer = make_optimizer(config.train, boxed)
    abstract = jax.eval_shape(lambda t: init_train_state(model, optimizer, t, config.train.seed), example)
    sh = sharding.step_shardings(abstract, boxed, mesh, config.mesh.rules)
    state = _abstract_tree(abstract, sh.state)
    keys = {"tokens": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32, "loss_mask": jnp.float32}
    batch_in = {k: jax.ShapeDtypeStruct((batch, seq_len), dt, sharding=sh.batch) for k, dt in keys.items()}
    step = jit_train_step(model, optimizer, config.train, sh)
    traced = step.trace(state, batch_in)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return traced.lower(lowering_platforms=("cpu",))
    return traced.lower()


# ------------------------------------------------------------------------------------------------ report

def plan(config: ExperimentConfig, mesh_cfg: MeshConfig, num_devices: int, *, batch: int, seq_len: int,
         cross_check: bool = True) -> dict[str, Any]:
    """The planner's report as a dict (the keys `experiments.plan --json` prints)."""
    counts = count_params(config.model)
    sizes = mesh_cfg.resolve(num_devices)
    boxed = abstract_params(config.model)
    report = {
        "total_params": counts["total"],
        "active_params": counts["active"],
        "active_params_with_embedding": counts["active_with_embedding"],
        "params_by_part": {k: v for k, v in counts.items()
                           if k not in ("total", "active", "active_with_embedding")},
        "flops_per_token": flops_per_token(config.model, seq_len),
        "mesh": sizes,
        "batch": batch,
        "seq_len": seq_len,
        "remat": config.model.remat,
        "bytes_per_device": memory_per_device(config, mesh_cfg, sizes, batch, seq_len, boxed),
        "replicated_by_fit": sharding.replicated_params(boxed, mesh_cfg.rules, sizes),
    }
    if cross_check:
        report["eval_shape_params"] = count_abstract(boxed)
        if report["eval_shape_params"] != counts["total"]:
            raise RuntimeError(f"analytic count {counts['total']:,} != eval_shape count "
                                 f"{report['eval_shape_params']:,}: plan.count_params is out of date")
    return report


def _unit(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def format_report(r: Mapping[str, Any]) -> str:
    gib = lambda b: f"{b / 2**30:,.2f} GiB"
    mesh = ", ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
    mem = r["bytes_per_device"]
    lines = [
        f"parameters      total {_unit(r['total_params'])} ({r['total_params']:,}), active "
        f"{_unit(r['active_params'])} (with embedding {_unit(r['active_params_with_embedding'])})",
        f"FLOPs / token   forward {_unit(r['flops_per_token']['forward'])}, train (3x) "
        f"{_unit(r['flops_per_token']['train'])}, with remat "
        f"{_unit(r['flops_per_token']['train_with_remat'])}  (seq_len {r['seq_len']})",
        f"mesh            {mesh}; batch {r['batch']} × {r['seq_len']}, remat={r['remat']}",
        f"per device      params {gib(mem['params'])}, optimizer {gib(mem['optimizer'])}, gradients "
        f"{gib(mem['gradients'])}, activations ~{gib(mem['activations'])}, total ~{gib(mem['total'])}",
    ]
    if r.get("replicated_by_fit"):
        lines.append(f"not fully split {len(r['replicated_by_fit'])} params lose a mesh axis the rules ask "
                     f"for (it does not divide the dimension), e.g. {r['replicated_by_fit'][0]}")
    if "lowers" in r:
        lines.append(f"lowers          {r['lowers']} on {r.get('lowered_on', '?')}"
                     + (f": {r['lower_error']}" if r.get("lower_error") else ""))
    return "\n".join(lines)
