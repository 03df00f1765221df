"""Metrics: JSONL and TensorBoard writers, throughput and MFU.

MFU = (analytic training FLOPs per token × tokens per second) / peak FLOP/s, where the
training FLOPs per token are 3× the forward matmul FLOPs of `step.model_flops_per_token`
(forward + backward ≈ 3 forward passes). The peak is `TrainConfig.peak_tflops`; when it is 0
it is measured once as the best rate of a large matmul in the run's compute dtype on the
current device.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

JSONL_KEYS = ("step", "loss", "bits_per_byte", "grad_norm", "learning_rate", "tokens_per_s",
              "mfu", "skipped_steps")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested metric dicts -> {"router/layer_0/max_vio": value, ...} with host values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "/"))
        else:
            arr = np.asarray(value)
            out[name] = arr.item() if arr.ndim == 0 else arr.tolist()
    return out


class MetricsWriter:
    """Appends one JSON object per record to metrics.jsonl and scalars to TensorBoard."""

    def __init__(self, workdir: str, enable_tensorboard: bool = True):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if enable_tensorboard:
            try:
                from tensorboardX import SummaryWriter  # light dependency, only when logging
            except ImportError:
                # An environment without it (an accelerator image, say) still trains and logs to JSONL.
                warnings.warn("TensorBoard logging is off: tensorboardX is not installed "
                              f"(pip install tensorboardX); metrics still go to {self.path}")
            else:
                self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, record: Mapping[str, Any], split: str = "train") -> None:
        flat = {"step": int(step), "split": split, **flatten(record)}
        self._file.write(json.dumps(flat) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in flat.items():
                if isinstance(value, (int, float)) and key not in ("step",):
                    self._tb.add_scalar(f"{split}/{key}", value, int(step))
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def measured_peak_flops(dtype=jnp.bfloat16, n: int = 1024, repeats: int = 5) -> float:
    """Best FLOP/s of an n³ matmul on the default device: the MFU denominator when none is set."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


class Throughput:
    """Tokens per second over the steps since the last call to `rate`."""

    def __init__(self):
        self._t = time.perf_counter()
        self._tokens = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def rate(self) -> float:
        now = time.perf_counter()
        rate = self._tokens / max(now - self._t, 1e-9)
        self._t, self._tokens = now, 0
        return rate
