"""HybridLM (DESIGN §3.5): embedding → KDA/MLA layers with dense or MoE FFNs → norm → head."""

from __future__ import annotations

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


class HybridLM(nn.Module):
    """tokens [B, T] (+ segment_ids, positions [B, T]) -> (logits [B, T, vocab] fp32, aux).

    aux = {"router": {"layer_i": stats}, "aux_loss": scalar}. Router state lives in the "router"
    variable collection: pass `mutable=["router"]` to `apply` to get the state for the next batch.
    """

    config: ModelConfig

    def _sublayers(self, index: int, kind: str):
        cfg = self.config
        dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        common = dict(d_model=cfg.d_model, dtype=dt, param_dtype=pdt, norm_eps=cfg.norm_eps)
        remat = cfg.remat in ("full", "all")
        remat_ffn = cfg.remat == "all"
        if kind == "K":
            attn = (nn.remat(KDA) if remat else KDA)(cfg.kda, name=f"layer_{index}_kda", **common)
        else:
            attn = (nn.remat(MLA) if remat else MLA)(cfg.mla, name=f"layer_{index}_mla", **common)
        if index < cfg.moe.first_k_dense:
            ffn = (nn.remat(DenseFFN) if remat_ffn else DenseFFN)(width=cfg.moe.dense_width, d_model=cfg.d_model,
                           activation=cfg.moe.activation, dtype=dt, param_dtype=pdt,
                           name=f"layer_{index}_ffn")
        else:
            ffn = (nn.remat(MoE) if remat_ffn else MoE)(cfg.moe, cfg.router, name=f"layer_{index}_moe", **common)
        return attn, ffn

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
        cfg = self.config
        dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        embedding = param_with_axes(self, "embedding", nn.initializers.normal(1.0),
                                    (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pdt)
        x = jnp.take(embedding, tokens, axis=0).astype(dt)
        use_sites = cfg.attn_res.mode != "none"
        stream = ResidualStream(cfg.attn_res, x)
        aux: dict[str, Any] = {"router": {}, "aux_loss": jnp.zeros((), jnp.float32)}

        for i, kind in enumerate(cfg.layer_kinds):
            attn, ffn = self._sublayers(i, kind)
            site = AttnResSite(eps=cfg.norm_eps, name=f"attn_res_{i}_attn") if use_sites else None
            h = RMSNorm(cfg.norm_eps, dt, pdt, name=f"layer_{i}_attn_norm")(stream.sublayer_input(site))
            if kind == "K":
                stream.add(attn(h, segment_ids))
            else:
                stream.add(attn(h, segment_ids, positions))

            site = AttnResSite(eps=cfg.norm_eps, name=f"attn_res_{i}_ffn") if use_sites else None
            h = RMSNorm(cfg.norm_eps, dt, pdt, name=f"layer_{i}_ffn_norm")(stream.sublayer_input(site))
            if i >= cfg.moe.first_k_dense:  # a MoE layer (remat may have wrapped its class)
                y, moe_aux = ffn(h)
                aux["router"][f"layer_{i}"] = moe_aux["router_stats"]
                aux["aux_loss"] = aux["aux_loss"] + moe_aux["aux_loss"]
            else:
                y = ffn(h)
            stream.add(y)
            stream.end_layer(i)

        site = AttnResSite(eps=cfg.norm_eps, name="attn_res_final") if use_sites else None
        x = RMSNorm(cfg.norm_eps, dt, pdt, name="final_norm")(stream.final(site))
        if cfg.tie_embeddings:
            logits = jnp.dot(x.astype(jnp.float32), embedding.astype(jnp.float32).T)
        else:
            logits = Dense(cfg.vocab_size, ("embed", "vocab"), dtype=dt, param_dtype=pdt,
                           name="head")(x)
        return logits.astype(jnp.float32), aux


def build_model(model_config: ModelConfig) -> HybridLM:
    """The model for a config; `init(rng, tokens)` gives {"params", "router"} variables."""
    return HybridLM(model_config)
