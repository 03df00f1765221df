"""The Mosaic TPU KDA kernels lower for a TPU target from the CPU: Pallas' TPU lowering (which enforces the TPU's
block tiling: last two block dims multiples of 8 and 128 or the array's own) runs without a TPU attached.

What this does not cover: the TPU compiler's own passes (layouts, VMEM allocation) run in libtpu, on a TPU only.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.kda.pallas_tpu import kda_pallas_tpu

# The bench shape's head and channel sizes, GVA (HV = 2H) and a length of a few 64-token chunks.
B, T, H, HV, D = 1, 256, 2, 4, 128
TPU_KINDS = ("TPU v5 lite", "TPU v6 lite")


def _target(kind):
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform="tpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def _lower_for_tpu(fn, args, kind):
    with _target(kind):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def _kda_loss(diagonal, segment_ids):
    def loss(q, k, v, g, beta, s0):
        o, state = kda_pallas_tpu(q, k, v, g, beta, s0, segment_ids, scale=D ** -0.5, chunk_size=64,
                                  diagonal=diagonal)
        return o.astype(jnp.float32).sum() + state.sum()

    return loss


def _args(dtype=jnp.bfloat16):
    s = jax.ShapeDtypeStruct
    return [s((B, T, H, D), dtype), s((B, T, H, D), dtype), s((B, T, HV, D), dtype), s((B, T, HV, D), jnp.float32),
            s((B, T, HV), dtype), s((B, HV, D, D), jnp.float32)]


@pytest.mark.parametrize("kind", TPU_KINDS)
@pytest.mark.parametrize("diagonal", [("dense", 16), ("pairwise", 16)])
def test_forward_and_backward_lower_for_mosaic_tpu(kind, diagonal):
    segment_ids = jnp.asarray(np.repeat([[1, 1, 2, 2]], T // 4, axis=1), jnp.int32)
    text = _lower_for_tpu(jax.grad(_kda_loss(diagonal, segment_ids), argnums=tuple(range(6))), _args(), kind)
    # intra forward, forward scan, reverse scan, state-side, score and input gradients
    assert text.count("tpu_custom_call") == 6


def test_fp32_inputs_lower_for_mosaic_tpu():
    text = _lower_for_tpu(jax.grad(_kda_loss(("dense", 16), None)), _args(jnp.float32), TPU_KINDS[0])
    assert text.count("tpu_custom_call") == 6


@pytest.mark.parametrize("block, legal", [((8, 128), True), ((8, 64), False), ((None, 128), False)])
def test_the_lowering_enforces_tpu_tiling(block, legal):
    # The check the tests above rely on: an illegal block is rejected at lowering time, on the CPU.
    def double(x):
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                              out_shape=jax.ShapeDtypeStruct((16, 256), jnp.float32), grid=(2, 2),
                              in_specs=[pl.BlockSpec(block, lambda i, j: (i, j))],
                              out_specs=pl.BlockSpec(block, lambda i, j: (i, j)))(x)

    args = [jax.ShapeDtypeStruct((16, 256), jnp.float32)]
    if legal:
        assert "tpu_custom_call" in _lower_for_tpu(double, args, TPU_KINDS[0])
    else:
        with pytest.raises(ValueError, match="divisible by 8 and 128"):
            _lower_for_tpu(double, args, TPU_KINDS[0])


def test_pallas_backend_picks_the_tpu_kernels_on_tpu(monkeypatch):
    from pallas_kernels.kda import api, chunk_kda
    from pallas_kernels.kda.testing import random_inputs

    x = random_inputs(0, batch=1, seq_len=48, heads=1, value_heads=1, key_dim=16, value_dim=16)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]

    def kernels():
        jaxpr = str(jax.make_jaxpr(lambda *a: chunk_kda(*a, g_min=-5.0, chunk_size=16, backend="pallas"))(*args))
        return "kda_tpu_intra_fwd" in jaxpr, re.search(r"kda_states?_fwd", jaxpr) is not None  # GPU forward scan

    assert kernels() == (False, True)  # here (CPU): the GPU kernels' trace
    monkeypatch.setattr(api.jax, "default_backend", lambda: "tpu")
    args = [a[:, :32] for a in args]  # a new shape: traced afresh
    assert kernels() == (True, False)
