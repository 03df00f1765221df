"""The pure train step: gradient accumulation, optimizer parameter groups, FLOP counting."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe import build_model
from hybridmoe.config import TrainConfig
from hybridmoe.train.optimizer import decay_mask, make_optimizer, optimizer_labels
from hybridmoe.train.step import init_train_state, model_flops_per_token, train_step
from tests.model_utils import small_config


def _setup(train_cfg, batch=4, length=32):
    cfg = small_config(num_layers=2)
    model = build_model(cfg)
    example = jnp.zeros((batch // train_cfg.grad_accum, length), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), example)["params"]
    opt = make_optimizer(train_cfg, shapes)
    state = init_train_state(model, opt, example, seed=0)
    tokens = jax.random.randint(jax.random.key(5), (batch, length + 1), 0, cfg.vocab_size)
    data = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": jnp.ones((batch, length), jnp.int32),
            "loss_mask": jnp.ones((batch, length), jnp.float32)}
    return model, opt, state, data


def _step(train_cfg, **kw):
    model, opt, state, data = _setup(train_cfg, **kw)
    return jax.jit(lambda s, b: train_step(s, b, model=model, optimizer=opt, train_cfg=train_cfg))(state, data)


def test_gradient_accumulation_equals_full_batch():
    base = TrainConfig(steps=10, warmup_steps=0, grad_clip=0.0)
    full_state, full = _step(base)
    accum_state, accum = _step(dataclasses.replace(base, grad_accum=2))
    np.testing.assert_allclose(full["loss"], accum["loss"], rtol=1e-5)
    np.testing.assert_allclose(full["grad_norm"], accum["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree_util.tree_leaves(full_state.params),
                    jax.tree_util.tree_leaves(accum_state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_decay_mask_spares_gains_biases_and_gate_constants():
    model, _, state, _ = _setup(TrainConfig())
    flat = {jax.tree_util.keystr(p): m for p, m in
            jax.tree_util.tree_leaves_with_path(decay_mask(state.params))}
    assert any("w_q" in k and v for k, v in flat.items())
    for key, decayed in flat.items():
        if any(n in key for n in ("'scale'", "a_log", "dt_bias", "'embedding'", "conv_")):
            assert not decayed, key


def test_muon_updates_matrices_and_leaves_the_rest_to_adamw():
    train_cfg = TrainConfig(optimizer="muon", steps=10, warmup_steps=0, learning_rate=1e-2)
    model, opt, state, data = _setup(train_cfg)
    new_state, metrics = jax.jit(
        lambda s, b: train_step(s, b, model=model, optimizer=opt, train_cfg=train_cfg))(state, data)
    assert bool(metrics["finite"])
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(state.params),
                                                      jax.tree_util.tree_leaves(new_state.params))]
    assert all(moved)
    inner = new_state.opt_state[1].inner_states
    assert set(inner) == {"adamw", "muon"}
    # Expert stacks [E, d, width] and plain matrices go to Muon; embeddings, norms and gates do not.
    labels = optimizer_labels(state.params)
    by_name = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(labels)}
    assert by_name["['layer_0_moe']['w_up']"] == "muon"
    assert by_name["['embedding']"] == "adamw" and by_name["['head']['kernel']"] == "adamw"
    assert by_name["['layer_0_kda']['a_log']"] == "adamw"


def test_flops_per_token_counts_each_layer_type():
    cfg = small_config()
    short, long = model_flops_per_token(cfg, 128), model_flops_per_token(cfg, 4096)
    assert short["kda"] > 0 and short["mla"] > 0 and short["moe"] > 0
    assert long["mla"] > short["mla"] and long["kda"] == short["kda"]  # attention grows with T, KDA does not
    assert short["total"] == sum(v for k, v in short.items() if k != "total")
