"""Context parallelism: KDA, its short convolution, MLA and the whole model on sequence shards equal one device.

Simulated devices need XLA_FLAGS before jax is imported, so the multi-device checks run this file as a subprocess
(`python tests/test_context_parallel.py layers|model`) and read back JSON, as tests/test_sharding.py does; the pytest
process keeps its single device for the in-process checks (the affine shard map, the errors).
"""

import dataclasses
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe import config as C
from hybridmoe import context_parallel, sharding
from hybridmoe.layers import mla as mla_module
from hybridmoe.layers.kda import KDA
from hybridmoe.layers.mla import MLA
from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.testing import random_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL_TOL = 1e-5
SEQ_LEN = 128
D_MODEL = 32
KDA_CFG = C.KDAConfig(num_heads=2, num_v_heads=4, head_dim=16, v_head_dim=8, chunk_size=16)
MLA_CFG = C.MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


def packed_segment_ids(seq_len=SEQ_LEN):
    """Two rows of packed documents. With 16 or 32 tokens per shard, row 0 starts a document exactly at a shard
    boundary (32) and inside a shard (53), then runs across several shards; row 1 reuses ids and has a one-token
    document at a shard's last position (63), so documents start at 16, 63 and 64."""
    t = np.arange(seq_len)
    row0 = np.select([t < 32, t < 53], [1, 2], 3)
    row1 = np.select([t < 16, t < 63, t < 64], [7, 8, 9], 7)
    return np.stack([row0, row1]).astype(np.int32)


def tiny_model():
    """fp32, d_model 64, a KDA and an MLA layer; capacity_factor=8 >= E/k: nothing drops, so per-shard capacities
    select the same tokens as one device."""
    return C.ModelConfig(
        vocab_size=259, d_model=64, num_layers=2, layer_pattern="KM", dtype="float32",
        kda=C.KDAConfig(num_heads=2, head_dim=16, chunk_size=16), mla=MLA_CFG,
        moe=C.MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, expert_width=32, capacity_factor=8.0))


# ------------------------------------------------------------------------------ in-process: no devices

def test_one_scan_gives_the_affine_map_of_the_incoming_state():
    """o(E) = o + reads·E and S_end(E) = M E + S⁰ for a random incoming E; a document start inside the row zeroes
    M (row 1), since the incoming state seeds only the first document."""
    x = random_inputs(0, batch=2, seq_len=32, heads=1, value_heads=2, key_dim=8, value_dim=4)
    seg = jnp.asarray(np.stack([np.ones(32), np.where(np.arange(32) < 20, 1, 2)]).astype(np.int32))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    options = dict(g_min=-5.0, chunk_size=16, backend="xla")
    o, reads, s0, m = context_parallel.scan_with_transition(None, *args, seg, **options)
    want_o, want_s = chunk_kda(*args, initial_state=x["initial_state"], output_final_state=True, segment_ids=seg,
                               **options)
    got_o = o + jnp.einsum("bthk,bhkv->bthv", reads, x["initial_state"])
    got_s = jnp.einsum("bhkj,bhjv->bhkv", m, x["initial_state"]) + s0
    np.testing.assert_allclose(got_o, want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_s, want_s, rtol=1e-5, atol=1e-6)
    assert np.asarray(m[0]).any() and not np.asarray(m[1]).any()


def _under_mesh(mesh_text, num_devices, fn):
    abstract = sharding.make_abstract_mesh(sharding.parse_mesh(mesh_text), num_devices)
    with jax.sharding.use_abstract_mesh(abstract), nn.logical_axis_rules(C.DEFAULT_RULES):
        return fn()


@pytest.mark.parametrize("seq_len,kda_cfg,message", [
    (100, KDA_CFG, r"sequence length 100 must be a multiple of the mesh's sequence axes sequence=8"),
    (64, KDA_CFG, r"KDAConfig.chunk_size=16 must not exceed the tokens per sequence shard: 64 tokens over "
                  r"sequence=8 leave 8"),
    (128, C.KDAConfig(num_heads=2, head_dim=16, chunk_size=16, conv_width=20),
     r"KDAConfig.conv_width=20 reaches 19 tokens back, more than the 16 tokens per sequence shard "
     r"\(128 over sequence=8\)"),
])
def test_kda_refuses_shards_it_cannot_run(seq_len, kda_cfg, message):
    module = KDA(kda_cfg, D_MODEL)
    x = jax.ShapeDtypeStruct((2, seq_len, D_MODEL), jnp.float32)
    variables = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), x))
    with pytest.raises(ValueError, match=message):
        _under_mesh("sequence=8", 8, lambda: jax.eval_shape(module.apply, variables, x))


def test_mla_refuses_a_backend_without_query_offsets(monkeypatch):
    def stand_in(q, k, v, segment_ids, scale, max_segments):  # cudnn_attention's signature, runs on the CPU
        return mla_module.xla_attention(q, k, v, segment_ids, scale)

    monkeypatch.setitem(mla_module.ATTENTION_BACKENDS, "cudnn", stand_in)
    module = MLA(dataclasses.replace(MLA_CFG, backend="cudnn"), D_MODEL)
    x = jax.ShapeDtypeStruct((2, 32, D_MODEL), jnp.float32)
    variables = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), x))
    with pytest.raises(ValueError, match=r"MLAConfig.backend='cudnn' takes no query offset, which context "
                                         r"parallelism over sequence=2 needs; use MLAConfig.backend='xla'"):
        _under_mesh("data=4,sequence=2", 8, lambda: jax.eval_shape(module.apply, variables, x))


def test_no_sequence_axis_means_no_context_parallelism():
    assert context_parallel.current() is None
    assert _under_mesh("data=4,tensor=2", 8, context_parallel.current) is None
    assert _under_mesh("data=2,sequence=4", 8, context_parallel.current) == \
        context_parallel.ContextParallel(("sequence",), 4)


# ------------------------------------------------------------------------- subprocesses: 8 CPU devices

def run_child(command, timeout=600):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), command], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_layers_on_sequence_shards_equal_one_device():
    """sequence=8 (16 tokens per shard): forward and gradients of the short convolution (packed and not), the bare
    KDA op without segment ids, the packed KDA layer (grouped value heads) and the packed MLA layer, all through the
    context-parallel collectives."""
    result = run_child("layers")
    for name, r in result.items():
        assert r["collectives"], (name, r)
        assert r["out_rel"] <= REL_TOL and r["grads_rel"] <= REL_TOL, (name, r)


def test_model_on_sequence_shards_equals_one_device():
    """Loss and every parameter gradient of the tiny model, packed documents, on sequence=8 and data=2,sequence=4."""
    result = run_child("model")
    assert set(result) == {"sequence=8", "data=2,sequence=4"}
    for mesh, r in result.items():
        assert r["collectives"], (mesh, r)
        assert r["loss_rel"] <= REL_TOL and r["grads_rel"] <= REL_TOL, (mesh, r)


# ------------------------------------------------------------------------------------- child programs

def _relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _worst(got, want):
    return max(_relative(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _random_params(module, *args, seed=0):
    """Parameters at init's shapes, drawn with numpy (no init compile): kernels ~ N(0, 1/fan_in), vectors ~ 1 + N;
    KDA's decay parameters as init draws them (a_log = 0, dt log-uniform in [1e-3, 1e-1]): slow decays, so the
    state really crosses shards."""
    rng = np.random.default_rng(seed)

    def draw(path, s):
        name = jax.tree_util.keystr(path[-1:])
        if name == "['a_log']":
            return np.zeros(s.shape, s.dtype)
        if name == "['dt_bias']":
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), s.shape))
            return (dt + np.log(-np.expm1(-dt))).astype(s.dtype)  # softplus⁻¹(dt)
        if s.ndim == 1:
            return (1.0 + 0.1 * rng.standard_normal(s.shape)).astype(s.dtype)
        return (rng.standard_normal(s.shape) / np.sqrt(s.size // s.shape[-1])).astype(s.dtype)

    return jax.tree_util.tree_map_with_path(draw, nn.unbox(jax.eval_shape(module.init, jax.random.key(0), *args)))


def _value_and_grads(fn, weights, argnums):
    """(params, *inputs) -> (fn's output, gradients of sum(output · weights) for `argnums`), one forward."""
    def run(*args):
        diff = lambda *d: fn(*(d[argnums.index(i)] if i in argnums else a for i, a in enumerate(args)))
        out, vjp = jax.vjp(diff, *(args[i] for i in argnums))
        return out, vjp(jnp.asarray(weights, out.dtype))
    return run


def _compare(fn, params, inputs, meshes, rules=C.DEFAULT_RULES):
    """fn(params, *inputs) -> array, on one device and over each of `meshes` (inputs split like a batch, params
    replicated): relative errors of the output and of the gradients (params and float inputs) of a random
    projection of it, and whether the sharded program has the context-parallel collectives."""
    weights = np.random.default_rng(1).standard_normal(jax.eval_shape(fn, params, *inputs).shape)
    argnums = (0, *(i + 1 for i, x in enumerate(inputs) if np.issubdtype(x.dtype, np.floating)))
    run = _value_and_grads(fn, weights, argnums)
    one = jax.device_put((params, *inputs), jax.devices()[0])
    want = jax.jit(run)(*one)
    out = {}
    for mesh in meshes:
        def traced(*args, mesh=mesh):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
                return run(*args)

        split = jax.sharding.NamedSharding(mesh, sharding.batch_spec(rules))
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        args = (jax.device_put(params, whole), *(jax.device_put(x, split) for x in inputs))
        lowered = jax.jit(traced).lower(*args)
        got = lowered.compile()(*args)
        hlo = lowered.as_text()
        out[_mesh_text(mesh)] = {"out_rel": _relative(got[0], want[0]), "grads_rel": _worst(got[1], want[1]),
                                 "collectives": "collective_permute" in hlo or "all_gather" in hlo}
    return out


def _mesh_text(mesh):
    return ",".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.axis_sizes) if n > 1)


def _local_or_sharded(local, sharded):
    """The op as a layer runs it: `sharded(cp, ...)` under a sequence mesh, `local(...)` otherwise."""
    def run(*args):
        cp = context_parallel.current()
        return local(*args) if cp is None else sharded(cp, *args)
    return run


def layers_child():
    from hybridmoe.layers.kda import causal_depthwise_conv
    mesh = sharding.make_mesh(sharding.parse_mesh("sequence=8"))
    rng = np.random.default_rng(0)
    seg = packed_segment_ids()
    x = rng.standard_normal((2, SEQ_LEN, D_MODEL)).astype(np.float32)
    w = rng.standard_normal((4, D_MODEL)).astype(np.float32)
    conv = _local_or_sharded(lambda w, x, seg: causal_depthwise_conv(x, w, seg),
                             lambda cp, w, x, seg: context_parallel.causal_conv(cp, causal_depthwise_conv, x, w, seg))
    # The bare op without segment ids (the layers below are packed); the token loop compiles fastest.
    opts = dict(g_min=-5.0, chunk_size=16, backend="reference")
    kda_op = _local_or_sharded(lambda _, *a: chunk_kda(*a, **opts)[0],
                               lambda cp, _, *a: context_parallel.kda(cp, *a, None, **opts))
    kda_in = random_inputs(1, batch=2, seq_len=SEQ_LEN, heads=1, value_heads=2, key_dim=8, value_dim=8)
    cases = {"conv": (conv, w, (x, seg)), "conv_unpacked": (lambda w, x: conv(w, x, None), w, (x,)),
             "kda_op_unpacked": (kda_op, {}, tuple(kda_in[n] for n in ("q", "k", "v", "g", "beta")))}
    for seed, (name, module) in enumerate((("kda", KDA(KDA_CFG, D_MODEL)), ("mla", MLA(MLA_CFG, D_MODEL)))):
        apply = lambda p, x, seg, module=module: module.apply(p, x, seg)
        cases[name] = (apply, _random_params(module, x, seed=seed), (x, seg))
    return {name: _compare(*case, [mesh])["sequence=8"] for name, case in cases.items()}


def model_child():
    from hybridmoe.model import build_model
    from hybridmoe.train.step import cross_entropy
    model = build_model(tiny_model())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 259, (2, SEQ_LEN), dtype=np.int32)
    seg = packed_segment_ids()
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)
    params = _random_params(model, tokens)["params"]
    router = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes["router"])  # bias_sign: a zero bias

    def loss(params, tokens, targets, seg):
        (logits, aux), _ = model.apply({"params": params, "router": router}, tokens, segment_ids=seg,
                                       mutable=["router"])
        return cross_entropy(logits, targets, jnp.ones(tokens.shape))[0] + aux["aux_loss"]

    meshes = [sharding.make_mesh(sharding.parse_mesh(text)) for text in ("sequence=8", "data=2,sequence=4")]
    result = _compare(loss, params, (tokens, np.roll(tokens, -1, axis=1), seg), meshes)
    return {mesh: {"loss_rel": r.pop("out_rel"), **r} for mesh, r in result.items()}


if __name__ == "__main__":
    children = {"layers": layers_child, "model": model_child}
    print(json.dumps(children[sys.argv[1]]()))
