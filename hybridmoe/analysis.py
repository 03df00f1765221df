"""Read-outs of trained models for ablations: AttnRes mixing weights per site, and their heat map."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.layers.attn_res import AttnResSite, _inv_rms


def site_weights(model, variables, batches) -> dict[str, np.ndarray]:
    """Mean softmax weight per source for every mixing site: {site name: [S]}."""
    totals: dict[str, np.ndarray] = {}

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, AttnResSite) and context.method_name == "__call__" and len(args[0]) > 1:
            params = nn.meta.unbox(module.variables["params"])
            q = params["key_norm"].astype(jnp.float32) * params["query"].astype(jnp.float32)
            logits = jnp.stack([jnp.dot(x.astype(jnp.float32), q) * _inv_rms(x.astype(jnp.float32), module.eps)
                                for x in args[0]])
            w = np.asarray(jax.nn.softmax(logits, axis=0).mean(axis=(1, 2)))
            totals[module.name] = totals.get(module.name, 0) + w
        return next_fun(*args, **kwargs)

    for batch in batches:
        with nn.intercept_methods(intercept):
            model.apply(variables, jnp.asarray(batch["tokens"]), segment_ids=jnp.asarray(batch["segment_ids"]))
    return {k: v / len(batches) for k, v in totals.items()}


def _site_order(name: str) -> tuple[int, int]:
    if name == "attn_res_final":
        return (10 ** 6, 0)
    _, _, layer, kind = name.split("_")
    return (int(layer), 0 if kind == "attn" else 1)


def plot_site_weights(results: dict[str, dict[str, np.ndarray]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 7), squeeze=False)
    for ax, (point, sites) in zip(axes[0], results.items()):
        names = sorted(sites, key=_site_order)
        width = max(len(sites[n]) for n in names)
        grid = np.full((len(names), width), np.nan)
        for i, n in enumerate(names):
            grid[i, :len(sites[n])] = sites[n]
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        ax.set_title(point, fontsize=9)
        ax.set_xlabel("source")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels([n.replace("attn_res_", "") for n in names], fontsize=6)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.6, label="mean softmax weight")
    fig.suptitle("AttnRes mixing weights per site (rows) over sources (columns: 0 = embedding, then "
                 "block sums or sublayer outputs, last = current partial sum)", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def router_layers(record: dict) -> list[str]:
    """The MoE layers a metrics record has router statistics for: ["layer_0", "layer_1", ...]."""
    return sorted({k.split("/")[1] for k in record if k.startswith("router/layer_")},
                  key=lambda name: int(name.split("_")[1]))


def router_summary(records: list[dict], last: int = 100) -> dict[str, float]:
    """Balance read-out of one run's training records (metrics.jsonl rows, split "train").

    Over the last `last` logged steps and every MoE layer: mean MaxVio (batch) and its window
    variant (NaN for routers without a window), mean dropped fraction, and the mean per-step smallest and largest expert load as
    multiples of the uniform load 1/E (1 = perfectly balanced). Needs log_every = 1 for "last"
    to mean steps rather than log records.
    """
    train = [r for r in records if r.get("split", "train") == "train"]
    if not train:
        raise ValueError("router_summary.records holds no training records")
    window = train[-last:]
    layers = router_layers(window[0])
    if not layers:
        raise ValueError("router_summary.records has no router/layer_i/* statistics")

    def mean_of(stat: str) -> float:  # NaN for a statistic the router does not keep
        return float(np.mean([[r.get(f"router/{layer}/{stat}", np.nan) for layer in layers]
                              for r in window]))

    loads = np.asarray([[r[f"router/{layer}/load"] for layer in layers] for r in window])  # [steps, L, E]
    experts = loads.shape[-1]
    return {"steps": len(window), "layers": len(layers), "experts": experts,
            "max_vio": mean_of("max_vio"), "max_vio_window": mean_of("max_vio_window"),
            "dropped_fraction": mean_of("dropped_fraction"),
            "min_load_x_uniform": float(np.mean(loads.min(-1)) * experts),
            "max_load_x_uniform": float(np.mean(loads.max(-1)) * experts)}
