"""ModelConfig.scan_layers: the same model as the unrolled layers, parameters stacked per group."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from hybridmoe import build_model
from hybridmoe import config as C
from hybridmoe import routing
from hybridmoe.train.step import cross_entropy
from tests.model_utils import small_config

PATTERN = "KKKM"


def _stacked(unrolled: dict, groups: int, period: int) -> dict:
    """Unrolled HybridLM variables -> scan_layers variables (layer g·P + j -> layers/layer_j[g])."""
    out = {k: v for k, v in unrolled.items() if not k.startswith("layer_")}
    per_j: dict[str, list] = {}
    for name in sorted(k for k in unrolled if k.startswith("layer_")):
        index, rest = re.fullmatch(r"layer_(\d+)_(.+)", name).groups()
        g, j = divmod(int(index), period)
        per_j.setdefault(f"layer_{j}_{rest}", [None] * groups)[g] = unrolled[name]
    out["layers"] = {k: jax.tree.map(lambda *xs: jnp.stack(xs), *v) for k, v in per_j.items()}
    return out


def _loss(model, variables, tokens, segment_ids):
    def loss(params):
        (logits, aux), updated = model.apply({"params": params, "router": variables["router"]}, tokens,
                                             segment_ids=segment_ids, mutable=["router"])
        ce = cross_entropy(logits, tokens, jnp.ones_like(tokens, jnp.float32))[0]
        return ce + aux["aux_loss"], (aux, updated)
    return jax.value_and_grad(loss, has_aux=True)(variables["params"])


# ("all", "group") in the default run; the other two (about 75 s each on 2 cores) with the slow tests.
@pytest.mark.parametrize("remat, scanned_remat", [pytest.param("none", "none", marks=pytest.mark.slow),
                                                  pytest.param("all", "all", marks=pytest.mark.slow),
                                                  ("all", "group")])
def test_scanned_layers_equal_the_unrolled_model(remat, scanned_remat):
    cfg = small_config(num_layers=8, remat=remat, router=C.RouterConfig(name="quantile"))
    tokens = jax.random.randint(jax.random.key(0), (2, 40), 0, cfg.vocab_size)
    segments = jnp.concatenate([jnp.ones((2, 25), jnp.int32), jnp.full((2, 15), 2, jnp.int32)], axis=1)
    unrolled = build_model(cfg)
    scanned = build_model(dataclasses.replace(cfg, scan_layers=True, remat=scanned_remat))
    v_unrolled = nn.unbox(unrolled.init(jax.random.key(1), tokens))
    v_scanned = jax.tree.map(lambda *x: x[0], nn.unbox(scanned.init(jax.random.key(1), tokens)))
    mapped = {c: _stacked(v_unrolled[c], 2, len(PATTERN)) for c in v_unrolled}
    assert jax.tree.structure(mapped) == jax.tree.structure(v_scanned)

    (l_u, (aux_u, upd_u)), g_u = _loss(unrolled, v_unrolled, tokens, segments)
    (l_s, (aux_s, upd_s)), g_s = _loss(scanned, mapped, tokens, segments)
    np.testing.assert_allclose(l_s, l_u, rtol=1e-5)
    assert sorted(aux_s["router"]) == sorted(aux_u["router"]) == [f"layer_{i}" for i in range(8)]
    for a, b in zip(jax.tree.leaves(aux_s["router"]), jax.tree.leaves(aux_u["router"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(_stacked(g_u, 2, len(PATTERN)))):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
    # The next batch's router state, group by group. The window's margins are stored as order-preserving
    # uint32 keys: compare the margins they encode (a margin near 0 moves its key by thousands for 1e-7),
    # margins of O(0.5) after four layers of fp32 activations, which differ by ~1e-6 between the two programs.
    for a, b in zip(jax.tree.leaves(upd_s["router"]), jax.tree.leaves(_stacked(upd_u["router"], 2, 4))):
        if a.dtype == jnp.uint32:
            np.testing.assert_allclose(routing._key_float(a), routing._key_float(b), rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_scanned_parameters_keep_their_logical_axes_behind_a_layer_axis():
    cfg = small_config(num_layers=8, scan_layers=True)
    variables = build_model(cfg).init(jax.random.key(1), jnp.zeros((1, 16), jnp.int32))
    kernel = variables["params"]["layers"]["layer_0_kda"]["w_q"]["kernel"]
    assert isinstance(kernel, nn.LogicallyPartitioned)
    assert kernel.value.shape[0] == 2 and kernel.names[0] is None and len(kernel.names) == kernel.value.ndim


@pytest.mark.parametrize("overrides, field", [
    (dict(attn_res=C.AttnResConfig(mode="block")), "AttnResConfig.mode"),
    (dict(num_layers=6), "ModelConfig.num_layers"),
    (dict(moe=C.MoEConfig(first_k_dense=1)), "MoEConfig.first_k_dense"),
])
def test_scan_layers_refuses_configs_it_cannot_scan(overrides, field):
    with pytest.raises(ValueError, match=field):
        small_config(**{"scan_layers": True, "num_layers": 8, **overrides})


def test_group_remat_needs_scanned_layers():
    with pytest.raises(ValueError, match="ModelConfig.remat.*scan_layers=True"):
        small_config(num_layers=8, remat="group")
