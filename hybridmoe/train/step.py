"""The train state and the pure train step `(state, batch) -> (state, metrics)`."""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from hybridmoe.config import ModelConfig, TrainConfig
from hybridmoe.train.optimizer import global_norm, learning_rate_schedule

Batch = dict[str, jax.Array]  # tokens, targets, segment_ids: int32 [B, T]; loss_mask: f32 [B, T]


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes; checkpointed whole (the data iterator rides beside it)."""

    step: jax.Array
    params: Any
    opt_state: Any
    router: Any  # router biases and statistics windows: never seen by the optimizer
    rng: jax.Array
    skipped_steps: jax.Array  # steps dropped by the non-finite guard


def init_train_state(model: nn.Module, optimizer: optax.GradientTransformation,
                     example_tokens: jax.Array, seed: int) -> TrainState:
    init_key, state_key = jax.random.split(jax.random.key(seed))
    variables = model.init(init_key, example_tokens)
    params = nn.meta.unbox(variables["params"])
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), router=variables.get("router", {}),
                      rng=jax.random.key_data(state_key), skipped_steps=jnp.zeros((), jnp.int32))


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Masked mean token cross-entropy in nats, and the number of counted tokens."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    count = jnp.maximum(mask.sum(), 1.0)
    return ((logz - picked) * mask).sum() / count, mask.sum()


def _loss_fn(params, router, model, batch: Batch):
    (logits, aux), updated = model.apply(
        {"params": params, "router": router}, batch["tokens"],
        segment_ids=batch["segment_ids"], mutable=["router"])
    loss, tokens = cross_entropy(logits, batch["targets"], batch["loss_mask"])
    return loss + aux["aux_loss"], (loss, aux, updated["router"], tokens)


def _split_microbatches(batch: Batch, n: int) -> Batch:
    return jax.tree_util.tree_map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)


def train_step(state: TrainState, batch: Batch, *, model: nn.Module,
               optimizer: optax.GradientTransformation, train_cfg: TrainConfig):
    """One optimizer step over `grad_accum` microbatches.

    Every microbatch routes with the state from before the step (a batch never routes with its
    own statistics); the router state kept for the next step is the update computed on the last
    microbatch. A non-finite loss or gradient leaves params and optimizer untouched and counts
    the step in `skipped_steps`.
    """
    n = train_cfg.grad_accum
    grad_fn = jax.value_and_grad(_loss_fn, has_aux=True)

    def micro(carry, mb):
        grads, loss_sum, _ = carry
        (_, (loss, aux, router, _)), g = grad_fn(state.params, state.router, model, mb)
        grads = jax.tree_util.tree_map(lambda a, b: a + b / n, grads, g)
        return (grads, loss_sum + loss / n, router), aux

    zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    (grads, loss, router), aux = jax.lax.scan(
        micro, (zeros, jnp.zeros((), jnp.float32), state.router), _split_microbatches(batch, n))
    aux = jax.tree_util.tree_map(lambda x: x[-1], aux)

    grad_norm = global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    keep = functools.partial(jax.tree_util.tree_map, lambda new, old: jnp.where(finite, new, old))
    new_state = state.replace(
        step=state.step + 1,
        params=keep(new_params, state.params),
        opt_state=keep(new_opt, state.opt_state),
        router=keep(router, state.router),
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32))
    metrics = {
        "loss": loss,
        "bits_per_token": loss / math.log(2.0),
        "grad_norm": grad_norm,
        "learning_rate": learning_rate_schedule(train_cfg)(state.step),
        "aux_loss": aux["aux_loss"],
        "finite": finite,
        "skipped_steps": new_state.skipped_steps,
        "router": aux["router"],
    }
    return new_state, metrics


def eval_step(params, router, batch: Batch, *, model: nn.Module):
    """Summed loss (nats) and token count over one batch, router state read-only."""
    logits, _ = model.apply({"params": params, "router": router}, batch["tokens"],
                            segment_ids=batch["segment_ids"])
    loss, tokens = cross_entropy(logits, batch["targets"], batch["loss_mask"])
    return loss * tokens, tokens


def jit_init_state(model: nn.Module, optimizer: optax.GradientTransformation,
                   micro_batch_shape: tuple[int, int], seed: int, shardings=None):
    """() -> TrainState, created directly in its shardings (`hybridmoe.sharding.StepShardings`)."""
    def init():
        return init_train_state(model, optimizer, jnp.zeros(micro_batch_shape, jnp.int32), seed)
    return jax.jit(init, out_shardings=None if shardings is None else shardings.state)


def jit_train_step(model: nn.Module, optimizer: optax.GradientTransformation,
                   train_cfg: TrainConfig, shardings=None):
    """The jitted step; with `shardings`, state and batch in/out shardings come from the logical rules
    and the step is traced inside the mesh + rules context (which turns on expert parallelism)."""
    fn = functools.partial(train_step, model=model, optimizer=optimizer, train_cfg=train_cfg)
    if shardings is None:
        return jax.jit(fn, donate_argnums=(0,))
    return jax.jit(shardings.traced(fn), in_shardings=(shardings.state, shardings.batch),
                   out_shardings=(shardings.state, shardings.replicated), donate_argnums=(0,))


def jit_eval_step(model: nn.Module, shardings=None):
    fn = functools.partial(eval_step, model=model)
    if shardings is None:
        return jax.jit(fn)
    return jax.jit(shardings.traced(fn),
                   in_shardings=(shardings.params, shardings.state.router, shardings.batch),
                   out_shardings=shardings.replicated)


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Analytic forward matmul FLOPs per token, by layer type (×3 for a training step).

    Counts 2·(multiply-adds) of every projection, the KDA chunk matmuls (per head: intra-chunk
    Aqk/L blocks, state read/write ≈ 2·C·K + 4·K·V per token), MLA attention (causal: T/2 keys
    on average, QKᵀ and PV), the routed experts actually used (top_k, 3 matrices) plus shared
    experts and the router, and the output head.
    """
    d, kda, mla, moe = cfg.d_model, cfg.kda, cfg.mla, cfg.moe
    h, hv, dk, dv = kda.num_heads, kda.value_heads, kda.head_dim, kda.value_dim
    kda_proj = d * (2 * h * dk + hv * dv) + d * dk + dk * hv * dk + d * hv + d * hv * dv + hv * dv * d
    kda_core = hv * (2 * kda.chunk_size * dk + 2 * kda.chunk_size * dv + 4 * dk * dv)
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    q_proj = (d * mla.q_lora_rank + mla.q_lora_rank * mla.num_heads * qk) if mla.q_lora_rank \
        else d * mla.num_heads * qk
    mla_proj = (q_proj + d * (mla.kv_lora_rank + mla.qk_rope_head_dim)
                + mla.kv_lora_rank * mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
                + (1 + mla.output_gate) * d * mla.num_heads * mla.v_head_dim)
    mla_core = mla.num_heads * (seq_len / 2) * (qk + mla.v_head_dim)
    width = moe.latent_dim or d
    # Routed experts work at the latent width; shared experts on the tokens themselves (d_model).
    moe_ffn = (3 * width * moe.expert_width * moe.top_k + 3 * d * moe.expert_width * moe.num_shared_experts
               + d * moe.num_experts
               + (2 * d * moe.latent_dim if moe.latent_dim else 0))
    dense_ffn = 3 * d * moe.dense_width
    out = {"kda": 0.0, "mla": 0.0, "moe": 0.0, "dense_ffn": 0.0, "head": 2.0 * d * cfg.vocab_size}
    for i, kind in enumerate(cfg.layer_kinds):
        if kind == "K":
            out["kda"] += 2.0 * (kda_proj + kda_core)
        else:
            out["mla"] += 2.0 * (mla_proj + mla_core)
        if i < moe.first_k_dense:
            out["dense_ffn"] += 2.0 * dense_ffn
        else:
            out["moe"] += 2.0 * moe_ffn
    out["total"] = sum(out.values())
    return out
