"""MLA against a plain per-head softmax attention, plus causality, packing isolation, options."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.config import MLAConfig
from hybridmoe.layers.mla import MLA, xla_attention

D_MODEL = 24
EPS = 1e-6


def _normal(seed, shape):
    # numpy, not jax.random: eager jax.random compiles a program per shape (seconds on a shared CPU).
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _cfg(**kw):
    base = dict(num_heads=2, q_lora_rank=0, kv_lora_rank=12, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6)
    return MLAConfig(**{**base, **kw})


def random_variables(module, *args, seed=0):
    """Variables at the shapes (and logical axes) `init` creates, values drawn with numpy.

    The tests need parameter values, not init's distribution; this skips compiling init's random ops,
    which costs seconds per shape on a shared CPU. Kernels ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.1²).
    """
    rng = np.random.default_rng(seed)

    def draw(s):
        if s.ndim == 1:
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(s.shape), s.dtype)
        return jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(s.size // s.shape[-1]), s.dtype)

    shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), *args)
    return jax.tree.map(draw, shapes)


def _init(cfg, x, seed=0):
    module = MLA(cfg, D_MODEL, norm_eps=EPS)
    return module, random_variables(module, x, seed=seed)


def _apply(module, variables, x, **kw):
    # Eager on purpose: the tests share shapes (B=2, T=8), so the per-op compile cache is reused,
    # which is cheaper than compiling a jitted graph per test on a shared 2-core CPU.
    return module.apply(variables, x, **kw)


def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _rope(x, pos, base):
    """x: [T, D] rotated by pos [T], half-split pairs (i, i + D/2)."""
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for i in range(half):
            a = pos[t] * base ** (-i / half)
            c, s = np.cos(a), np.sin(a)
            out[t, i] = x[t, i] * c - x[t, i + half] * s
            out[t, i + half] = x[t, i + half] * c + x[t, i] * s
    return out


def naive_mla(p, x, cfg, segment_ids=None):
    """Plain numpy (float64) gated MLA, one batch row and one head at a time."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    x = np.asarray(x, np.float64)
    b_size, t_len, _ = x.shape
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out = np.zeros_like(x)
    for b in range(b_size):
        seg = np.zeros(t_len, int) if segment_ids is None else np.asarray(segment_ids[b])
        pos = np.zeros(t_len, int)  # position inside the document
        for t in range(1, t_len):
            pos[t] = pos[t - 1] + 1 if seg[t] == seg[t - 1] else 0
        xb = x[b]
        if cfg.q_lora_rank:
            q = np.einsum("tr,rhe->the", _rms(xb @ p["wq_a"]["kernel"], p["q_norm"]["scale"]),
                          p["wq_b"]["kernel"])
        else:
            q = np.einsum("td,dhe->the", xb, p["wq"]["kernel"])
        kv_a = xb @ p["wkv_a"]["kernel"]
        c_kv = _rms(kv_a[:, :cfg.kv_lora_rank], p["kv_norm"]["scale"])
        k_shared = kv_a[:, cfg.kv_lora_rank:]
        kv = np.einsum("tr,rhe->the", c_kv, p["wkv_b"]["kernel"])
        heads = []
        for h in range(cfg.num_heads):
            qh, kh_shared = q[:, h], k_shared
            if cfg.use_rope:
                qh = np.concatenate([qh[:, :dn], _rope(qh[:, dn:], pos, cfg.rope_base)], -1)
                kh_shared = _rope(k_shared, pos, cfg.rope_base)
            kh = np.concatenate([kv[:, h, :dn], kh_shared], -1)
            vh = kv[:, h, dn:]
            oh = np.zeros((t_len, dv))
            for t in range(t_len):
                allowed = [s for s in range(t + 1) if seg[s] == seg[t]]
                logits = np.array([qh[t] @ kh[s] for s in allowed]) / np.sqrt(dn + dr)
                w = np.exp(logits - logits.max())
                oh[t] = (w / w.sum()) @ vh[allowed]
            if cfg.output_gate:
                oh = oh / (1 + np.exp(-(xb @ p["w_gate"]["kernel"][:, h])))
            heads.append(oh)
        out[b] = np.einsum("thv,hvd->td", np.stack(heads, 1), p["wo"])
    return out


@pytest.mark.parametrize("q_lora,gate,rope,packed", [
    (0, True, False, True), (8, False, False, True), (8, True, True, True),
    (0, False, True, False), (0, True, True, True),
])
def test_matches_naive_attention(q_lora, gate, rope, packed):
    cfg = _cfg(q_lora_rank=q_lora, output_gate=gate, use_rope=rope)
    x = _normal(1, (2, 8, D_MODEL))
    seg = jnp.array([[1] * 3 + [2] * 5, [3] * 2 + [4] * 5 + [5]]) if packed else None
    module, variables = _init(cfg, x)
    got = _apply(module, variables, x, segment_ids=seg)
    want = naive_mla(nn.unbox(variables["params"]), x, cfg, seg)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert ("wq_a" in variables["params"]) == bool(q_lora)
    assert ("w_gate" in variables["params"]) == gate


def test_every_param_has_logical_axes():
    cfg = _cfg(q_lora_rank=8)
    x = jnp.zeros((2, 8, D_MODEL))
    _, variables = _init(cfg, x)
    leaves = jax.tree.leaves(variables["params"], is_leaf=lambda a: isinstance(a, nn.Partitioned))
    assert leaves and all(isinstance(a, nn.Partitioned) and len(a.names) == a.value.ndim for a in leaves)
    assert variables["params"]["wo"].names == ("heads", "head_dim", "embed")
    assert variables["params"]["wkv_b"]["kernel"].names == ("kv_lora", "heads", "head_dim")


@pytest.mark.parametrize("rope", [False, True])
def test_causal_bitwise(rope):
    cfg = _cfg(q_lora_rank=8, use_rope=rope)
    x = _normal(2, (2, 8, D_MODEL))
    module, variables = _init(cfg, x)
    tau = 4
    x2 = x.at[:, tau + 1:].add(_normal(3, (2, 8 - tau - 1, D_MODEL)))
    y1, y2 = _apply(module, variables, x), _apply(module, variables, x2)
    np.testing.assert_array_equal(np.asarray(y1[:, :tau + 1]), np.asarray(y2[:, :tau + 1]))
    assert not np.allclose(y1[:, tau + 1:], y2[:, tau + 1:])


@pytest.mark.parametrize("rope", [False, True])
def test_packed_documents_are_isolated(rope):
    cfg = _cfg(use_rope=rope)
    # Row 0 packs documents a (3 tokens) and b (5 tokens); row 1 holds b alone, padded after it
    # with a third document, so "alone" shares the packed call's shapes.
    a = _normal(4, (3, D_MODEL))
    b = _normal(5, (5, D_MODEL))
    c = _normal(6, (3, D_MODEL))
    x = jnp.stack([jnp.concatenate([a, b]), jnp.concatenate([b, c])])
    seg = jnp.array([[1] * 3 + [2] * 5, [1] * 5 + [2] * 3])
    module, variables = _init(cfg, x)
    y = _apply(module, variables, x, segment_ids=seg)
    np.testing.assert_allclose(y[0, 3:], y[1, :5], rtol=1e-5, atol=1e-5)
    # "Alone" without any segment ids: b at the start of an unpacked row, a alone likewise.
    alone = _apply(module, variables, jnp.stack([jnp.concatenate([b, c]), jnp.concatenate([a, b])]))
    np.testing.assert_allclose(y[0, 3:], alone[0, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y[0, :3], alone[1, :3], rtol=1e-5, atol=1e-5)


def test_explicit_positions_drive_rope():
    cfg = _cfg(use_rope=True)
    x = _normal(6, (2, 8, D_MODEL))
    module, variables = _init(cfg, x)
    default = _apply(module, variables, x)
    arange = jnp.broadcast_to(jnp.arange(8), (2, 8))
    same = _apply(module, variables, x, positions=arange)
    shifted = _apply(module, variables, x, positions=arange * 3)
    np.testing.assert_allclose(default, same, rtol=1e-6, atol=1e-6)
    assert not np.allclose(default, shifted)


def test_bf16_close_to_fp32():
    cfg = _cfg(q_lora_rank=8)
    x = _normal(7, (2, 8, D_MODEL))
    module, variables = _init(cfg, x)
    ref = _apply(module, variables, x)
    low = _apply(MLA(cfg, D_MODEL, dtype=jnp.bfloat16, norm_eps=EPS), variables, x)
    assert low.dtype == jnp.bfloat16
    rel = jnp.sqrt(jnp.mean((low.astype(jnp.float32) - ref) ** 2) / jnp.mean(ref ** 2))
    assert rel < 0.02


def test_unknown_backend_is_an_error_naming_the_available_ones(monkeypatch):
    from hybridmoe.layers import mla
    monkeypatch.delitem(mla.ATTENTION_BACKENDS, "pallas")  # a build without the splash module
    cfg = _cfg(backend="pallas")
    x = jnp.zeros((2, 8, D_MODEL))
    with pytest.raises(ValueError, match=r"MLAConfig.backend='pallas' is not available in this build; use 'cudnn', "
                                         r"'pallas_flash', 'pallas_flash_interpret', 'pallas_interpret', 'xla'"):
        _init(cfg, x)


def test_cudnn_backend_refuses_fp32_activations():
    cfg = _cfg(backend="cudnn")
    x = jnp.zeros((2, 8, D_MODEL))
    with pytest.raises(ValueError, match=r"MLAConfig.backend='cudnn' needs bf16 or fp16 activations, got float32"):
        _init(cfg, x)


@pytest.mark.parametrize("with_segments", [False, True])
def test_query_blocks_compute_the_same_attention(with_segments):
    keys = jax.random.split(jax.random.key(3), 3)
    q, k = (jax.random.normal(key, (2, 64, 2, 8)) for key in keys[:2])
    v = jax.random.normal(keys[2], (2, 64, 2, 4))
    ids = jnp.cumsum(jax.random.bernoulli(jax.random.key(4), 0.1, (2, 64)), axis=1) if with_segments else None

    def loss(q, k, v, block):
        return jnp.sum(jnp.sin(xla_attention(q, k, v, ids, 0.3, query_block=block)))

    whole, whole_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, None)
    for block in (16, 24):  # 24: a ragged last block (padded rows, outputs dropped)
        blocked, blocked_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, block)
        np.testing.assert_allclose(blocked, whole, rtol=1e-6)
        for a, b in zip(blocked_grads, whole_grads):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="query_block must be a positive number of rows, got 0"):
        xla_attention(q, k, v, ids, 0.3, query_block=0)


def test_long_ragged_queries_never_hold_the_whole_logit_matrix():  # forward and backward
    # T·S above QUERY_BLOCK_MIN_LOGITS with T not a multiple of QUERY_BLOCK (a prompt plus its answer):
    # the default still works in blocks, so temporaries stay far below one [T, S] fp32 matrix.
    t = 32768 + 5
    q = jax.ShapeDtypeStruct((1, t, 1, 8), jnp.float32)
    v = jax.ShapeDtypeStruct((1, t, 1, 4), jnp.float32)
    whole_matrix = t * t * 4
    compiled = jax.jit(lambda q, k, v: xla_attention(q, k, v, None, 0.3)).lower(q, q, v).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < whole_matrix / 4
    # The backward too: it must not keep every block's softmax for the gradient.
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(xla_attention(q, k, v, None, 0.3)), argnums=(0, 1, 2)))
    assert grad.lower(q, q, v).compile().memory_analysis().temp_size_in_bytes < whole_matrix / 3


def test_cudnn_backend_gets_the_configured_max_segments(monkeypatch):
    from hybridmoe.layers import mla as mla_module
    seen = []

    def fake_cudnn(q, k, v, segment_ids, scale, max_segments):  # records what MLA passes on
        seen.append(max_segments)
        return xla_attention(q, k, v, segment_ids, scale)

    monkeypatch.setitem(mla_module.ATTENTION_BACKENDS, "cudnn", fake_cudnn)
    x = jax.random.normal(jax.random.key(0), (1, 8, D_MODEL))
    _init(_cfg(backend="cudnn", max_segments=3), x)
    assert seen and set(seen) == {3}
    with pytest.raises(ValueError, match="MLAConfig.max_segments must be"):
        _cfg(max_segments=0)
