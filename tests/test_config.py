"""Config validation: every bad field names itself, its value and the allowed range."""

import os

import pytest

from hybridmoe import config as C
from hybridmoe import load_config


@pytest.mark.parametrize("cls, kwargs, message", [
    (C.KDAConfig, {"g_min": 0.5}, "KDAConfig.g_min must be in [-20.0, 0.0), got 0.5"),
    (C.KDAConfig, {"g_min": -25.0}, "KDAConfig.g_min must be in [-20.0, 0.0)"),
    (C.KDAConfig, {"head_dim": 0}, "KDAConfig.head_dim must be a positive integer, got 0"),
    (C.KDAConfig, {"num_heads": 4, "num_v_heads": 6}, "KDAConfig.num_v_heads must be a multiple"),
    (C.KDAConfig, {"gate": "relu"}, "KDAConfig.gate must be one of 'bounded', 'softplus'"),
    (C.KDAConfig, {"chunk_size": 40}, "KDAConfig.chunk_size must be a positive multiple of 16"),
    (C.KDAConfig, {"backend": "cuda"}, "KDAConfig.backend must be one of"),
    (C.MLAConfig, {"kv_lora_rank": -1}, "MLAConfig.kv_lora_rank must be a positive integer"),
    (C.MLAConfig, {"use_rope": True, "qk_rope_head_dim": 3}, "MLAConfig.qk_rope_head_dim must be even"),
    (C.MLAConfig, {"backend": "flash"}, "MLAConfig.backend must be one of"),
    (C.MoEConfig, {"num_experts": 4, "top_k": 5}, "MoEConfig.top_k must be in [1, num_experts=4], got 5"),
    (C.MoEConfig, {"activation": "gelu"}, "MoEConfig.activation must be one of"),
    (C.MoEConfig, {"capacity_factor": 0.0}, "MoEConfig.capacity_factor must be in (0.0"),
    (C.RouterConfig, {"name": "hash"}, "RouterConfig.name must be one of"),
    (C.RouterConfig, {"rate": 0.0}, "RouterConfig.rate must be in (0.0, 1.0]"),
    (C.RouterConfig, {"window": 0}, "RouterConfig.window must be a positive integer"),
    (C.RouterConfig, {"stats": "sketch"}, "RouterConfig.stats must be one of"),
    (C.AttnResConfig, {"mode": "dense"}, "AttnResConfig.mode must be one of"),
    (C.AttnResConfig, {"block_size": 0}, "AttnResConfig.block_size must be a positive integer"),
    (C.ModelConfig, {"layer_pattern": "KKXM"}, "ModelConfig.layer_pattern must be a non-empty string of letters in {K, M}"),
    (C.ModelConfig, {"d_model": -8}, "ModelConfig.d_model must be a positive integer"),
    (C.ModelConfig, {"dtype": "float16"}, "ModelConfig.dtype must be one of"),
    (C.DataConfig, {"seq_len": 0}, "DataConfig.seq_len must be a positive integer"),
    (C.DataConfig, {"source": "array_record"}, "DataConfig.path must be a directory"),
    (C.TrainConfig, {"learning_rate": 0.0}, "TrainConfig.learning_rate must be in (0.0, 1.0]"),
    (C.TrainConfig, {"optimizer": "sgd"}, "TrainConfig.optimizer must be one of"),
    (C.TrainConfig, {"on_nonfinite": "ignore"}, "TrainConfig.on_nonfinite must be one of"),
    (C.MeshConfig, {"data": 0}, "MeshConfig.data must be a positive integer or -1"),
    (C.MeshConfig, {"data": -1, "fsdp": -1}, "MeshConfig.-1 axes must be at most one"),
])
def test_validation_messages(cls, kwargs, message):
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    assert message in str(info.value)


def test_first_k_dense_bounded_by_layers():
    with pytest.raises(ValueError, match="MoEConfig.first_k_dense"):
        C.ModelConfig(num_layers=2, moe=C.MoEConfig(first_k_dense=3))


@pytest.mark.parametrize("layers, pattern, expected_mla", [
    (4, "KKKM", [4]),
    (27, "KKKM", [4, 8, 12, 16, 20, 24, 27]),  # Kimi-Linear-48B
    (93, "KKKM", list(range(4, 93, 4)) + [93]),  # K3: 69 KDA + 24 MLA
])
def test_layer_kinds_match_published_layouts(layers, pattern, expected_mla):
    kinds = C.ModelConfig(num_layers=layers, layer_pattern=pattern).layer_kinds
    assert len(kinds) == layers
    assert [i + 1 for i, k in enumerate(kinds) if k == "M"] == expected_mla


def test_load_tiny_config_with_binding():
    cfg = load_config(["configs/tiny.gin"], ["KDAConfig.g_min = -4.0", "MoEConfig.top_k = 1"])
    m = cfg.model
    assert (m.d_model, m.num_layers, m.layer_kinds) == (256, 4, "KKKM")
    assert (m.moe.num_experts, m.moe.top_k, m.moe.num_shared_experts) == (8, 1, 1)
    assert m.kda.g_min == -4.0 and m.kda.bound == -4.0
    assert m.vocab_size == 259 and cfg.data.seq_len == 512


def test_load_config_rejects_bad_binding_and_leaves_no_bindings_behind():
    with pytest.raises(ValueError, match="KDAConfig.g_min must be in"):
        load_config(["configs/tiny.gin"], ["KDAConfig.g_min = 1.0"])
    assert C.KDAConfig().g_min == -5.0  # the failed binding does not leak into later configs
    load_config(["configs/tiny.gin"], ["KDAConfig.g_min = -4.0"])
    assert C.KDAConfig().g_min == -5.0


def test_config_text_round_trips(tmp_path):
    config, text = C.load_config_and_text(["configs/tiny.gin"], ["KDAConfig.g_min = -4.0"])
    saved = tmp_path / "config.gin"
    saved.write_text(text)
    assert load_config([str(saved)]) == config


def test_router_options_only_for_chosen_router():
    assert C.RouterConfig(name="quantile", window=4).options() == {
        "window": 4, "rate": 1.0, "stats": "exact", "bins": 256}
    assert C.RouterConfig(name="bias_sign").options() == {"gamma": 1e-3}


def test_nested_config_includes_resolve_from_any_cwd(tmp_path, monkeypatch):
    nested = os.path.abspath("configs/ablations/attn_res_16l.gin")
    monkeypatch.chdir(tmp_path)
    cfg = load_config([nested])
    assert cfg.model.num_layers == 16 and cfg.model.d_model == 128
    assert os.getcwd() == str(tmp_path)
