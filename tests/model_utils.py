"""Small model configs and helpers shared by model-level tests."""

import dataclasses

import jax
import jax.numpy as jnp

from hybridmoe import build_model
from hybridmoe import config as C


def small_config(**overrides) -> C.ModelConfig:
    """A tiny fp32 model where nothing is dropped by MoE capacity (equality tests)."""
    base = C.ModelConfig(
        vocab_size=259, d_model=32, num_layers=4, layer_pattern="KKKM", dtype="float32",
        kda=C.KDAConfig(num_heads=2, head_dim=16, chunk_size=16),
        mla=C.MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=8),
        moe=C.MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, expert_width=32,
                        capacity_factor=8.0),
    )
    return dataclasses.replace(base, **overrides)


def init_model(cfg: C.ModelConfig, batch: int = 2, length: int = 40, seed: int = 0):
    model = build_model(cfg)
    tokens = jax.random.randint(jax.random.key(seed), (batch, length), 0, cfg.vocab_size)
    variables = model.init(jax.random.key(seed + 1), tokens)
    return model, variables, tokens


def logits_of(model, variables, tokens, segment_ids=None):
    logits, _ = model.apply(variables, tokens, segment_ids=segment_ids)
    return logits


def packed_pair(key, len_a: int, len_b: int, vocab: int):
    """Two documents, packed into one row with segment ids 1 and 2."""
    ka, kb = jax.random.split(key)
    a = jax.random.randint(ka, (1, len_a), 0, vocab)
    b = jax.random.randint(kb, (1, len_b), 0, vocab)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.concatenate([jnp.ones((1, len_a), jnp.int32), 2 * jnp.ones((1, len_b), jnp.int32)], 1)
    return a, b, packed, seg
