"""HybridLM (DESIGN §3.5): embedding → KDA/MLA layers with dense or MoE FFNs → norm → head."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridmoe.config import ModelConfig
from hybridmoe.layers.attn_res import AttnResSite, ResidualStream
from hybridmoe.layers.common import Dense, RMSNorm, dtype_of, param_with_axes
from hybridmoe.layers.kda import KDA
from hybridmoe.layers.mla import MLA
from hybridmoe.layers.moe import DenseFFN, MoE


def _attention(mdl: nn.Module, x, segment_ids, positions, *, cfg: ModelConfig, index: int, kind: str):
    """Layer `index`'s attention branch: RMSNorm -> KDA or MLA, on the branch input x [B, T, d]."""
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    common = dict(d_model=cfg.d_model, dtype=dt, param_dtype=pdt, norm_eps=cfg.norm_eps)
    h = RMSNorm(cfg.norm_eps, dt, pdt, name=f"layer_{index}_attn_norm")(x)
    if kind == "K":
        return KDA(cfg.kda, name=f"layer_{index}_kda", **common)(h, segment_ids)
    return MLA(cfg.mla, name=f"layer_{index}_mla", **common)(h, segment_ids, positions)


def _ffn(mdl: nn.Module, x, *, cfg: ModelConfig, index: int):
    """Layer `index`'s FFN branch: RMSNorm -> dense FFN or MoE. -> (y, MoE aux or None)."""
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    h = RMSNorm(cfg.norm_eps, dt, pdt, name=f"layer_{index}_ffn_norm")(x)
    if index < cfg.moe.first_k_dense:
        return DenseFFN(width=cfg.moe.dense_width, d_model=cfg.d_model, activation=cfg.moe.activation,
                        dtype=dt, param_dtype=pdt, name=f"layer_{index}_ffn")(h), None
    return MoE(cfg.moe, cfg.router, d_model=cfg.d_model, dtype=dt, param_dtype=pdt, norm_eps=cfg.norm_eps,
               name=f"layer_{index}_moe")(h)


def _branches(cfg: ModelConfig, index: int, kind: str):
    """(attention, ffn) branch functions of layer `index`, called as f(module, x, ...), remat applied.

    The pre-norm sits inside the rematerialised function, so a remat'd branch keeps only its input
    [B, T, d] for the backward pass: with the norm outside, each branch also kept the normalised copy
    and the norm's fp32 intermediates, per token per sublayer (the bulk of a deep long-context step).
    """
    attn = functools.partial(_attention, cfg=cfg, index=index, kind=kind)
    ffn = functools.partial(_ffn, cfg=cfg, index=index)
    if cfg.remat in ("full", "all", "group"):
        attn = nn.remat(attn)
    if cfg.remat in ("all", "group"):
        ffn = nn.remat(ffn)
    return attn, ffn


class LayerGroup(nn.Module):
    """One repeat of `layer_pattern` with the plain pre-norm residual: the body of scan_layers.

    (x [B, T, d], segment_ids, positions) -> (x, ({"layer_j": router stats}, aux loss)); j counts
    layers inside the group, and names the group's parameters like HybridLM's (layer_j_kda, ...).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids, positions):
        cfg = self.config
        stats, aux_loss = {}, jnp.zeros((), jnp.float32)
        for j, kind in enumerate(cfg.layer_pattern):
            attn, ffn = _branches(cfg, j, kind)
            x = x + attn(self, x, segment_ids, positions)
            y, moe_aux = ffn(self, x)
            stats[f"layer_{j}"] = moe_aux["router_stats"]
            aux_loss = aux_loss + moe_aux["aux_loss"]
            x = x + y
        return x, (stats, aux_loss)


class HybridLM(nn.Module):
    """tokens [B, T] (+ segment_ids, positions [B, T]) -> (logits [B, T, vocab] fp32, aux).

    aux = {"router": {"layer_i": stats}, "aux_loss": scalar}. Router state lives in the "router"
    variable collection: pass `mutable=["router"]` to `apply` to get the state for the next batch.
    With `scan_layers`, parameters and router state of the groups sit stacked under "layers".
    """

    config: ModelConfig

    def _scanned_layers(self, x, segment_ids, positions, aux):
        cfg = self.config
        period = len(cfg.layer_pattern)
        groups = cfg.num_layers // period
        # remat="group": the backward recomputes a whole group from its input; inside it each
        # branch is rematerialised again, so only that group's branch inputs are held at a time.
        body = nn.remat(LayerGroup, prevent_cse=False) if cfg.remat == "group" else LayerGroup
        scan = nn.scan(body, variable_axes={"params": 0, "router": 0},
                       split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast),
                       length=groups, metadata_params={nn.PARTITION_NAME: None})
        # A scan body takes and returns its carry first: x.
        x, (stats, aux_loss) = scan(cfg, name="layers")(x, segment_ids, positions)
        for g in range(groups):
            for j in range(period):
                aux["router"][f"layer_{g * period + j}"] = jax.tree.map(lambda a: a[g], stats[f"layer_{j}"])
        aux["aux_loss"] = aux["aux_loss"] + jnp.sum(aux_loss)
        return x

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
        cfg = self.config
        dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        embedding = param_with_axes(self, "embedding", nn.initializers.normal(1.0),
                                    (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pdt)
        x = jnp.take(embedding, tokens, axis=0).astype(dt)
        aux: dict[str, Any] = {"router": {}, "aux_loss": jnp.zeros((), jnp.float32)}
        if cfg.scan_layers:
            x = self._scanned_layers(x, segment_ids, positions, aux)
            x = RMSNorm(cfg.norm_eps, dt, pdt, name="final_norm")(x)
            return self._head(x, embedding), aux

        use_sites = cfg.attn_res.mode != "none"
        stream = ResidualStream(cfg.attn_res, x)

        for i, kind in enumerate(cfg.layer_kinds):
            attn, ffn = _branches(cfg, i, kind)
            site = AttnResSite(eps=cfg.norm_eps, name=f"attn_res_{i}_attn") if use_sites else None
            stream.add(attn(self, stream.sublayer_input(site), segment_ids, positions))
            site = AttnResSite(eps=cfg.norm_eps, name=f"attn_res_{i}_ffn") if use_sites else None
            y, moe_aux = ffn(self, stream.sublayer_input(site))
            if moe_aux is not None:
                aux["router"][f"layer_{i}"] = moe_aux["router_stats"]
                aux["aux_loss"] = aux["aux_loss"] + moe_aux["aux_loss"]
            stream.add(y)
            stream.end_layer(i)

        site = AttnResSite(eps=cfg.norm_eps, name="attn_res_final") if use_sites else None
        x = RMSNorm(cfg.norm_eps, dt, pdt, name="final_norm")(stream.final(site))
        return self._head(x, embedding), aux

    def _head(self, x, embedding):
        cfg = self.config
        if cfg.tie_embeddings:
            logits = jnp.dot(x.astype(jnp.float32), embedding.astype(jnp.float32).T)
        else:
            logits = Dense(cfg.vocab_size, ("embed", "vocab"), dtype=dtype_of(cfg.dtype),
                           param_dtype=dtype_of(cfg.param_dtype), name="head")(x)
        return logits.astype(jnp.float32)


def build_model(model_config: ModelConfig) -> HybridLM:
    """The model for a config; `init(rng, tokens)` gives {"params", "router"} variables."""
    return HybridLM(model_config)
