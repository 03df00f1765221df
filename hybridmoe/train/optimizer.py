"""Optimizers: AdamW with warmup + cosine, or Muon for matrices with AdamW for the rest.

Never weight-decayed, never Muon: embeddings, the output head, norm scales, biases, the KDA
gate's A_log and dt_bias, convolution taps. Router biases are not parameters at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from hybridmoe.config import TrainConfig

# Parameter names (last path element) that are gains, biases or gate constants.
_NO_DECAY_NAMES = ("scale", "bias", "a_log", "dt_bias", "embedding", "o_norm", "query", "key_norm")


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to cfg.learning_rate, then cosine decay to min_lr_ratio of it."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio)


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _is_plain(path, leaf) -> bool:
    """True for parameters that must get neither weight decay nor Muon."""
    names = _path_names(path)
    if names[-1] in _NO_DECAY_NAMES or leaf.ndim < 2:
        return True
    return any(n.startswith("conv_") or n == "head" for n in names)


def decay_mask(params):
    return jax.tree_util.tree_map_with_path(lambda p, x: not _is_plain(p, x), params)


def _muon_dims(path, leaf):
    """Muon dimension numbers: matrices, and expert stacks [E, in, out] batched over experts."""
    if leaf.ndim == 2:
        return optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)
    if leaf.ndim == 3 and any(n.endswith("_moe") for n in _path_names(path)):  # [E, d_in, d_out]
        return optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    return None


def optimizer_labels(params):
    """"muon" for matrices and expert stacks, "adamw" for everything Muon must not touch."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: "adamw" if _is_plain(p, x) or _muon_dims(p, x) is None else "muon", params)


def make_optimizer(cfg: TrainConfig, params) -> optax.GradientTransformation:
    """Gradient clipping, then AdamW or Muon(+AdamW). `params` may be boxed (logical axes)."""
    params = nn.meta.unbox(params)
    lr = learning_rate_schedule(cfg)
    adamw = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                        mask=decay_mask(params))
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    if cfg.optimizer == "adamw":
        return optax.chain(clip, adamw)

    labels = optimizer_labels(params)
    dims = jax.tree_util.tree_map_with_path(
        lambda p, x, label: _muon_dims(p, x) if label == "muon" else None, params, labels)
    muon = optax.contrib.muon(lr, beta=cfg.b1, weight_decay=cfg.weight_decay,
                              muon_weight_dimension_numbers=dims)
    return optax.chain(clip, optax.multi_transform({"adamw": adamw, "muon": muon}, labels))


def global_norm(tree) -> jax.Array:
    return optax.global_norm(jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), tree))
