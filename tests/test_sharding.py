"""Sharding: mesh and rule validation, logical specs, and sharded == unsharded train steps on 8 CPU devices.

Simulated devices need XLA_FLAGS before jax is imported, so every multi-device check runs this file as a
subprocess (`python tests/test_sharding.py equality MESH... --dispatch=...`) and reads back JSON; the
pytest process itself keeps its single device.
"""

import json
import os
import subprocess
import sys

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hybridmoe import config as C
from hybridmoe import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = ["data=8", "fsdp=4,tensor=2", "data=2,expert=4", "fsdp=2,expert=2,tensor=2"]
REL_TOL = 1e-5


def micro_model(dispatch="capacity", router="quantile", pattern="KM"):
    """fp32, two layers (KDA + MLA), 4 experts: dimensions divide every mesh above (vocab 259 does not:
    the embedding and head then stay replicated along `tensor`). capacity_factor=8 >= E/k: nothing drops,
    so per-shard and global capacities select the same tokens. pattern="M": one MLA layer (fast suite)."""
    return C.ModelConfig(
        vocab_size=259, d_model=32, num_layers=len(pattern), layer_pattern=pattern, dtype="float32",
        kda=C.KDAConfig(num_heads=2, head_dim=16, chunk_size=16),
        mla=C.MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=8),
        moe=C.MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, expert_width=32,
                        capacity_factor=8.0, dispatch=dispatch),
        router=C.RouterConfig(name=router, stats="histogram", window=2))


# ------------------------------------------------------------------------------ in-process: no devices

def test_parse_mesh_and_resolve():
    cfg = sharding.parse_mesh("fsdp=64,expert=64,tensor=4")
    assert cfg.resolve(16384) == {"data": 1, "fsdp": 64, "expert": 64, "tensor": 4, "sequence": 1}
    assert sharding.parse_mesh("data=-1,tensor=2").resolve(8)["data"] == 4
    with pytest.raises(ValueError, match="--mesh entry 'pipeline=2' must look like AXIS=SIZE"):
        sharding.parse_mesh("pipeline=2")
    with pytest.raises(ValueError, match=r"MeshConfig.sizes must be axis sizes whose product equals "
                                         r"the device count 8, got 'data=2 × fsdp=2"):
        C.MeshConfig(data=2, fsdp=2).resolve(8)
    with pytest.raises(ValueError, match="MeshConfig.data must be resolvable: 8 devices are not a "
                                         "multiple of the other axes' product 3"):
        C.MeshConfig(tensor=3).resolve(8)


def test_rules_validate_and_bind_from_gin():
    with pytest.raises(ValueError, match=r"MeshConfig.rules must be a pair \(logical name"):
        C.MeshConfig(rules=(("embed", "model"),))
    try:
        cfg = C.load_config([os.path.join(ROOT, "configs/tiny.gin")],
                            ['MeshConfig.rules = (("embed", None), ("batch", ["data", "fsdp"]))'])
    finally:
        gin.clear_config()
    assert cfg.mesh.rules == (("embed", None), ("batch", ("data", "fsdp")))
    hash(cfg.mesh)  # keys the compiled-step cache


def test_logical_specs_fit_and_dedupe():
    rules = C.DEFAULT_RULES
    assert sharding.logical_to_spec(("head_dim", "heads", "head_dim"), rules) == P(None, "tensor", None)
    assert sharding.logical_to_spec(("expert", "embed", "mlp"), rules) == P("expert", "fsdp", "tensor")
    sizes = {"data": 1, "fsdp": 4, "expert": 2, "tensor": 2, "sequence": 1}
    assert sharding.fit_spec(P("tensor", "fsdp"), (259, 32), sizes) == P(None, "fsdp")
    assert sharding.fit_spec(P(("fsdp", "expert"),), (8,), sizes) == P(("fsdp", "expert"))
    assert sharding.fit_spec(P(("fsdp", "expert"),), (6,), sizes) == P("expert")


def test_param_and_optimizer_specs():
    from hybridmoe.model import build_model
    from hybridmoe.train.optimizer import make_optimizer
    model = build_model(micro_model())
    boxed = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((2, 16), jnp.int32))["params"]
    sizes = {"data": 1, "fsdp": 4, "expert": 2, "tensor": 2, "sequence": 1}
    specs = sharding.param_specs(boxed, C.DEFAULT_RULES, sizes)
    moe = specs["layer_1_moe"]
    assert moe["w_gate"] == P("expert", "fsdp", "tensor") and moe["w_down"] == P("expert", "tensor", "fsdp")
    assert moe["w_router"] == P("fsdp", "expert")  # `expert` taken by E: d falls back to fsdp alone
    assert specs["layer_0_kda"]["w_q"]["kernel"] == P(("fsdp", "expert"), "tensor")
    assert specs["embedding"] == P(None, ("fsdp", "expert"))  # 259 rows do not split over tensor=2
    assert "['embedding']" in sharding.replicated_params(boxed, C.DEFAULT_RULES, sizes)
    params = jax.tree.map(lambda x: x, __import__("flax").linen.meta.unbox(boxed))
    opt = jax.eval_shape(make_optimizer(C.TrainConfig(), boxed).init, params)
    opt_specs = sharding.specs_like_params(opt, params, specs)
    mu = opt_specs[1][0].mu  # chain(clip, adamw): adamw's ScaleByAdamState
    assert mu["layer_1_moe"]["w_gate"] == P("expert", "fsdp", "tensor")
    assert opt_specs[1][0].count == P()


@pytest.mark.parametrize("mesh,router,message", [
    ("data=2", C.RouterConfig(name="quantile", stats="exact"),
     r"RouterConfig.stats='exact' keeps each shard's own statistics window: with tokens split over mesh "
     r"axes \('data',\), router 'quantile' needs RouterConfig.stats='histogram'"),
    ("expert=8", C.RouterConfig(), r"MoEConfig.num_experts=4 must be a multiple of the mesh's expert axes "
                                   r"\('expert',\) of total size 8"),
])
def test_moe_under_a_mesh_refuses_what_cannot_shard(mesh, router, message):
    import functools
    import flax.linen as nn
    from hybridmoe.layers.moe import MoE
    module = MoE(micro_model().moe, router, 32)
    x = jax.ShapeDtypeStruct((2, 8, 32), jnp.float32)
    variables = jax.eval_shape(module.init, jax.random.key(0), x)
    abstract = sharding.make_abstract_mesh(sharding.parse_mesh(mesh), 8 if "8" in mesh else 2)
    with jax.sharding.use_abstract_mesh(abstract), nn.logical_axis_rules(C.DEFAULT_RULES):
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(functools.partial(module.apply, mutable=["router"]), variables, x)


# ------------------------------------------------------------- Quantile Balancing statistics over shards

def _skewed_scores(rng, tokens, num_experts):
    """Sigmoid scores with popular and unpopular experts (per-expert offsets up to ±1.5 logits)."""
    logits = rng.standard_normal((tokens, num_experts)) + np.linspace(-1.5, 1.5, num_experts)
    return (1 / (1 + np.exp(-logits))).astype(np.float32)


def _upper_quantile(values, top_k):
    """Per expert, the (q+1)-th largest of values [N, E], q = N·k/E (the router's Quantile_{1-k/E})."""
    n, e = values.shape
    q = n * top_k // e
    return -np.sort(-values, axis=0)[q]


def _max_vio(scores, bias, top_k):
    ids = np.argsort(-(scores + bias), axis=1)[:, :top_k]
    counts = np.bincount(ids.ravel(), minlength=scores.shape[1])
    return float(counts.max() / counts.mean() - 1)


def _update_biases(scores, biases, num_shards, top_k, bins):
    """One Quantile Balancing update of each way's bias from a batch split over `num_shards` shards.

    global: the quantile of all margins (what one device computes); hist: the quantile of per-shard
    histograms summed over shards (routing's stats="histogram" with axis_name); avg: the mean of per-shard
    exact quantiles. Each way routes with its own current bias (the margins depend on it)."""
    from hybridmoe import routing
    centre = lambda b: b - b.mean()
    out = {}
    for way, bias in biases.items():
        cutoff = -np.sort(-(scores + bias), axis=1)[:, top_k]  # (k+1)-th largest biased score
        margins = scores - cutoff[:, None]
        shards = np.split(margins, num_shards)
        if way == "global":
            out[way] = centre(-_upper_quantile(margins, top_k))
        elif way == "hist":
            hist = sum(np.asarray(routing._histogram(jnp.asarray(m), (-1.0, 1.0), bins)) for m in shards)
            out[way] = centre(-np.asarray(routing._histogram_upper_quantile(jnp.asarray(hist), (-1.0, 1.0),
                                                                             top_k)))
        else:
            out[way] = centre(-np.mean([_upper_quantile(m, top_k) for m in shards], axis=0))
    return out


def quantile_shard_errors(num_shards, tokens_per_shard, num_experts=64, top_k=4, bins=256, seed=0,
                          steps=12):
    """Summed histograms vs averaged per-shard quantiles against the global quantile, on skewed sigmoid
    scores: the first update's mean |b - b_global| (all from bias 0), and each way's MaxVio averaged over
    the last half of `steps` updates, every step routing a fresh batch with that way's own bias."""
    rng = np.random.default_rng(seed)
    zero = np.zeros(num_experts, np.float32)
    biases = {way: zero for way in ("global", "hist", "avg")}
    vio = {way: [] for way in biases}
    first = None
    for step in range(steps):
        scores = _skewed_scores(rng, num_shards * tokens_per_shard, num_experts)
        for way, bias in biases.items():
            vio[way].append(_max_vio(scores, bias, top_k))
        biases = _update_biases(scores, biases, num_shards, top_k, bins)
        if first is None:
            first = {w: float(np.mean(np.abs(biases[w] - biases["global"]))) for w in ("hist", "avg")}
    late = lambda v: float(np.mean(v[steps // 2:]))
    return {"hist_err": first["hist"], "avg_err": first["avg"], "bin_width": 2.0 / bins,
            **{f"{w}_max_vio": late(v) for w, v in vio.items()}}


def test_summed_histograms_track_the_global_quantile_better_than_averaged_quantiles():
    """benchmarks/results/quantile_shards.md: with small shards the per-shard quantile is biased (its
    rank q = N_s·k/E is coarse) and averaging keeps the bias; summed histograms stay within a bin."""
    r = quantile_shard_errors(num_shards=16, tokens_per_shard=128, steps=2)
    assert r["hist_err"] <= r["bin_width"]
    assert r["hist_err"] < r["avg_err"]


# ------------------------------------------------------------------------- subprocesses: 8 CPU devices

def run_child(*args, devices=8, timeout=900):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(results):
    for mesh, r in results.items():
        assert r["loss_rel"] <= REL_TOL, (mesh, r)
        assert r["params_rel"] <= REL_TOL, (mesh, r)
        assert r["router_abs"] <= 1e-5, (mesh, r)
        assert r["dropped"] == 0.0, (mesh, r)  # equality needs equal capacities: nothing may drop


def test_sharded_step_equals_unsharded_one_mesh():
    """Fast suite: FSDP × expert × tensor parallelism at once, capacity path, quantile histograms."""
    _check(run_child("equality", "fsdp=2,expert=2,tensor=2", "--dispatch=capacity", "--pattern=M"))


@pytest.mark.slow
@pytest.mark.parametrize("dispatch,router", [("capacity", "quantile"), ("dropless", "bias_sign")])
def test_sharded_step_equals_unsharded_all_meshes(dispatch, router):
    _check(run_child("equality", *MESHES, f"--dispatch={dispatch}", f"--router={router}"))


# ------------------------------------------------------------------------------------- child programs

def _relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _batch(batch_size=8, seq_len=32, vocab=259):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch_size, seq_len), dtype=np.int32)
    segment_ids = np.where(np.arange(seq_len) < seq_len // 3, 1, 2).astype(np.int32)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
            "segment_ids": np.broadcast_to(segment_ids, tokens.shape).copy(),
            "loss_mask": np.ones(tokens.shape, np.float32)}


def equality_child(meshes, dispatch, router, pattern):
    """One fp32 train step on each mesh against the same step on one device, from the same state."""
    from hybridmoe.model import build_model
    from hybridmoe.train.optimizer import make_optimizer
    from hybridmoe.train.step import init_train_state, jit_train_step
    model = build_model(micro_model(dispatch, router, pattern))
    tcfg = C.TrainConfig(warmup_steps=0, learning_rate=1e-2)
    batch = _batch()
    example = jax.ShapeDtypeStruct(batch["tokens"].shape, jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.key(0), example)["params"]
    optimizer = make_optimizer(tcfg, boxed)
    fresh = lambda: init_train_state(model, optimizer, jnp.zeros(example.shape, jnp.int32), 0)
    state0 = jax.device_get(fresh())
    ref, ref_m = jit_train_step(model, optimizer, tcfg)(jax.device_put(state0, jax.devices()[0]),
                                                        jax.device_put(batch, jax.devices()[0]))
    abstract = jax.eval_shape(lambda t: init_train_state(model, optimizer, t, 0), example)
    moe_weight = lambda state: state.params[f"layer_{len(pattern) - 1}_moe"]["w_gate"]
    out = {}
    for text in meshes:
        mesh_cfg = sharding.parse_mesh(text)
        mesh = sharding.make_mesh(mesh_cfg)
        sh = sharding.step_shardings(abstract, boxed, mesh, mesh_cfg.rules)
        step = jit_train_step(model, optimizer, tcfg, sh)
        new, m = step(jax.device_put(state0, sh.state), jax.device_put(batch, sh.batch))
        worst = max(_relative(a, b) for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref.params)))
        router_abs = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                         for a, b in zip(jax.tree.leaves(new.router), jax.tree.leaves(ref.router)))
        out[text] = {"loss": float(m["loss"]), "loss_ref": float(ref_m["loss"]),
                     "loss_rel": abs(float(m["loss"]) - float(ref_m["loss"])) / abs(float(ref_m["loss"])),
                     "params_rel": worst, "router_abs": router_abs,
                     "dropped": max(float(v["dropped_fraction"]) for v in m["router"].values()),
                     "expert_sharding": str(moe_weight(new).sharding.spec)}
    return out


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    flags = dict(a[2:].split("=", 1) for a in rest if a.startswith("--"))
    positional = [a for a in rest if not a.startswith("--")]
    if command == "quantile_table":
        result = {f"{s}x{n}/seed{seed}": quantile_shard_errors(s, n, seed=seed) for s, n in
                  [(2, 4096), (8, 1024), (16, 128), (64, 128), (64, 1024), (256, 64)] for seed in [0, 1, 2]}
    elif command == "equality":
        result = equality_child(positional, flags.get("dispatch", "capacity"),
                                flags.get("router", "quantile"), flags.get("pattern", "KM"))
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result))
