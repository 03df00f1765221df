"""Table and plots of the router ablation (a finished `experiments.sweep` over routers and E).

python -m experiments.routing_ablation_report --sweep_dir=runs/routing_ablation \
    --out=benchmarks/results/routing_ablation

Per point: final validation loss (the sweep's result.json), and from the training records of the
last --last steps (`hybridmoe.analysis.router_summary`, mean over MoE layers): MaxVio, smallest and
largest expert load as multiples of the uniform 1/E, dropped fraction. Writes OUT.json, OUT.md and
OUT.png (MaxVio and validation loss against step, one panel per expert count).
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from hybridmoe.analysis import router_layers, router_summary

SWEEP_DIR = flags.DEFINE_string("sweep_dir", "runs/routing_ablation", "The sweep's workdir.")
OUT = flags.DEFINE_string("out", "benchmarks/results/routing_ablation", "Output path prefix.")
LAST = flags.DEFINE_integer("last", 100, "Training steps the balance statistics average over.")
COMMAND = flags.DEFINE_string("command", "", "The sweep's command line, quoted in the table's header.")


def _point_fields(name: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in name.split(","))


def _label(fields: dict[str, str]) -> str:
    extra = {k: v for k, v in fields.items() if k not in ("num_experts", "name")}
    return fields["name"] + "".join(f" {k}={v}" for k, v in extra.items())


def load_points(sweep_dir: str, last: int) -> list[dict]:
    points = []
    for name in sorted(os.listdir(sweep_dir)):
        path = os.path.join(sweep_dir, name)
        if not os.path.exists(os.path.join(path, "result.json")):
            continue
        with open(os.path.join(path, "result.json"), encoding="utf-8") as f:
            result = json.load(f)
        with open(os.path.join(path, "metrics.jsonl"), encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        fields = _point_fields(name)
        train = [r for r in records if r["split"] == "train"]
        layers = router_layers(train[0])
        points.append({
            "point": name, "router": _label(fields), "E": int(fields["num_experts"]),
            "val_loss": result["val_loss"], **router_summary(records, last),
            "curve_steps": [r["step"] for r in train],
            "curve_max_vio": [float(np.mean([r[f"router/{l}/max_vio"] for l in layers])) for r in train],
            "val_steps": [r["step"] for r in records if r["split"] == "validation"],
            "val_losses": [r["loss"] for r in records if r["split"] == "validation"],
        })
    if not points:
        raise app.UsageError(f"--sweep_dir={sweep_dir}: no finished points (no */result.json)")
    order = ["softmax_topk_aux", "bias_sign", "quantile", "expert_threshold"]
    points.sort(key=lambda p: (p["E"], order.index(p["router"].split()[0]),
                               int(_point_fields(p["point"]).get("window", 0))))
    return points


def write_table(points: list[dict], out: str) -> None:
    cols = ("val_loss", "max_vio", "max_vio_window", "min_load_x_uniform", "max_load_x_uniform",
            "dropped_fraction")
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump([{k: p[k] for k in ("point", "router", "E", "steps", "layers", *cols)} for p in points],
                  f, indent=1)
    lines = ["# Router ablation: tiny hybrid model on the embedded data", ""]
    if COMMAND.value:
        lines += [f"`{COMMAND.value}`", ""]
    lines += [f"Final validation loss; balance statistics are means over the last {points[0]['steps']} "
              f"training steps and the {points[0]['layers']} MoE layers (per step, per layer: MaxVio = "
              "max load / mean load - 1; min / max load as multiples of the uniform load 1/E; dropped = "
              "assignments over the capacity).", "",
              "| E | router | val loss | MaxVio | MaxVio (window) | min load ×1/E | max load ×1/E | dropped |",
              "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['E']} | {p['router']} | {p['val_loss']:.4f} | {p['max_vio']:.3f} | "
                     f"{'-' if np.isnan(p['max_vio_window']) else format(p['max_vio_window'], '.3f')} | {p['min_load_x_uniform']:.3f} | "
                     f"{p['max_load_x_uniform']:.3f} | {p['dropped_fraction']:.4f} |")
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(points: list[dict], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    experts = sorted({p["E"] for p in points})
    fig, axes = plt.subplots(2, len(experts), figsize=(6 * len(experts), 8), squeeze=False)
    for col, e in enumerate(experts):
        for p in (p for p in points if p["E"] == e):
            axes[0, col].plot(p["curve_steps"], p["curve_max_vio"], label=p["router"], lw=1)
            axes[1, col].plot(p["val_steps"], p["val_losses"], marker="o", label=p["router"])
        axes[0, col].set(title=f"E = {e}: MaxVio per step (mean over layers)", xlabel="step",
                         ylabel="MaxVio", yscale="log")
        axes[1, col].set(title=f"E = {e}: validation loss", xlabel="step", ylabel="loss")
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    plt.close(fig)


def main(argv):
    del argv
    points = load_points(SWEEP_DIR.value, LAST.value)
    os.makedirs(os.path.dirname(OUT.value) or ".", exist_ok=True)
    write_table(points, OUT.value)
    plot(points, OUT.value)


if __name__ == "__main__":
    app.run(main)
