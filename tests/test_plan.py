"""Planner: analytic counts against eval_shape and the published totals, memory, the JSON report, lowering."""

import dataclasses
import json
import os
import subprocess
import sys

import gin
import pytest

from hybridmoe import config as C
from hybridmoe import plan, sharding
from tests.test_sharding import micro_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(name):
    try:
        return C.load_config([os.path.join(ROOT, "configs", name)])
    finally:
        gin.clear_config()  # gin-configurable defaults would otherwise leak into later tests


def test_published_totals_k3():
    counts = plan.count_params(_config("k3.gin").model)
    assert abs(counts["total"] / 2.78e12 - 1) < 0.03, counts["total"]
    assert abs(counts["active"] / 103e9 - 1) < 0.03, counts["active"]  # head counted, embedding not
    assert abs(counts["active_with_embedding"] / 103e9 - 1) < 0.03


def test_published_totals_kimi_linear_48b():
    counts = plan.count_params(_config("kimi_linear_48b.gin").model)
    assert abs(counts["total"] / 49e9 - 1) < 0.03, counts["total"]
    assert 2.7e9 <= counts["active"] <= 3.5e9, counts["active"]


@pytest.mark.parametrize("variant", [
    {},
    {"attn_res": C.AttnResConfig(mode="block", block_size=1), "tie_embeddings": True},
    {"mla": C.MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, output_gate=False),
     "moe": C.MoEConfig(num_experts=4, top_k=2, num_shared_experts=2, expert_width=16, latent_dim=8,
                        first_k_dense=1, dense_width=24)},
])
def test_analytic_count_equals_eval_shape(variant):
    cfg = dataclasses.replace(micro_model(), **variant)
    assert plan.count_params(cfg)["total"] == plan.count_abstract(plan.abstract_params(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kimi_linear_48b.gin", "k3.gin"])
def test_analytic_count_equals_eval_shape_reference_configs(name):
    cfg = _config(name).model
    assert plan.count_params(cfg)["total"] == plan.count_abstract(plan.abstract_params(cfg))


def test_report_keys_and_memory_on_one_device():
    config = dataclasses.replace(C.ExperimentConfig(), model=micro_model())
    mesh = C.MeshConfig(data=1)
    r = plan.plan(config, mesh, 1, batch=2, seq_len=32)
    for key in ("total_params", "active_params", "flops_per_token", "bytes_per_device"):
        assert key in r
    assert r["bytes_per_device"]["params"] == 4 * r["total_params"]  # fp32, nothing split
    assert r["bytes_per_device"]["optimizer"] == pytest.approx(8 * r["total_params"], rel=1e-3)  # Adam
    assert r["flops_per_token"]["train"] == 3 * r["flops_per_token"]["forward"]
    split = plan.plan(config, sharding.parse_mesh("fsdp=4,expert=2"), 8, batch=8, seq_len=32)
    assert split["bytes_per_device"]["params"] < r["bytes_per_device"]["params"] / 4
    json.dumps(r)


def _plan_cli(*args, timeout=1800):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "experiments.plan", "--json", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_cli_lowers_tiny_on_fake_devices():
    r = _plan_cli("--gin_file=configs/tiny.gin", "--mesh=fsdp=2,expert=2,tensor=2", "--fake_devices=8",
                  "--seq_len=64")
    assert r["lowers"] is True, r.get("lower_error")
    assert r["lowered_on"] == "8 fake CPU devices"


@pytest.mark.slow
def test_cli_k3_lowers_on_512_fake_devices():
    r = _plan_cli("--gin_file=configs/k3.gin", "--mesh=fsdp=8,expert=16,tensor=4", "--fake_devices=512",
                  "--seq_len=1024")
    assert r["lowers"] is True, r.get("lower_error")
    assert abs(r["total_params"] / 2.78e12 - 1) < 0.03
