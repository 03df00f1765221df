"""Sweep a grid of gin bindings: one training run per point, then a table and a plot.

python -m experiments.sweep --gin_file=configs/tiny.gin --sweep='KDAConfig.g_min=[-3,-5,-8]' \
    [--sweep='RouterConfig.window=[1,4]'] --steps=200 --workdir=runs/sweep_gmin

Points run sequentially, each in WORKDIR/<point name>; a point whose `result.json` exists is
skipped on restart (an interrupted point resumes from its checkpoint). Writes results.csv,
results.md and curves.png (validation loss against step, one line per point) to WORKDIR.
"""

from __future__ import annotations

import csv
import json
import os
import re
from typing import Any, Sequence

from absl import app, flags, logging

from hybridmoe import load_config
from hybridmoe.sweeps import binding_string, grid, parse_point, parse_sweep, point_name
from hybridmoe.train.loop import train

GIN_FILES = flags.DEFINE_multi_string("gin_file", ["configs/tiny.gin"], "Gin config files.")
GIN_PARAMS = flags.DEFINE_multi_string("gin_param", [], "Bindings shared by every point.")
SWEEP = flags.DEFINE_multi_string("sweep", [], "'Class.field=[v1,v2,...]'; several flags make a grid.")
POINT = flags.DEFINE_multi_string(
    "point", [], "One explicit point, 'Class.a=1;Class.b=\"x\"'; added after the grid's points.")
STEPS = flags.DEFINE_integer("steps", None, "Override TrainConfig.steps for every point.")
WORKDIR = flags.DEFINE_string("workdir", "runs/sweep", "Where points, table and plot go.")

ROUTER_STATS = ("max_vio", "min_load", "dropped_fraction", "load_entropy")
RESULT_COLUMNS = ("point", "val_loss", "val_bits_per_byte", "tokens_per_s", *ROUTER_STATS)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(workdir: str) -> dict[str, Any]:
    """Final validation numbers and router stats (mean over MoE layers, last 10 train records)."""
    records = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    val = [r for r in records if r["split"] == "validation"]
    train_recs = [r for r in records if r["split"] == "train"]
    out = {"val_loss": val[-1]["loss"] if val else float("nan"),
           "val_bits_per_byte": val[-1]["bits_per_byte"] if val else float("nan"),
           "tokens_per_s": train_recs[-1]["tokens_per_s"] if train_recs else float("nan")}
    for stat in ROUTER_STATS:
        values = [v for r in train_recs[-10:] for k, v in r.items()
                  if k.startswith("router/") and k.endswith("/" + stat)]
        out[stat] = sum(values) / len(values) if values else float("nan")
    return out


def run_point(point: dict[str, Any], root: str, gin_files, shared_bindings, steps) -> dict:
    name = point_name(point)
    workdir = os.path.join(root, name)
    done = os.path.join(workdir, "result.json")
    if os.path.exists(done):
        logging.info("Skipping finished point %s", name)
        with open(done, encoding="utf-8") as f:
            return json.load(f)
    bindings = list(shared_bindings) + [binding_string(k, v) for k, v in point.items()]
    if steps is not None:
        bindings.append(f"TrainConfig.steps = {steps}")
    config = load_config(gin_files, bindings)
    result = train(config, workdir, progress=False)
    if result.interrupted:
        raise KeyboardInterrupt(f"point {name} interrupted; rerun to resume")
    summary = {"point": name, **summarise(workdir)}
    with open(done, "w", encoding="utf-8") as f:
        json.dump(summary, f)
    return summary


def write_table(rows: list[dict], root: str) -> None:
    with open(os.path.join(root, "results.csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_COLUMNS)
        writer.writeheader()
        writer.writerows({k: r.get(k) for k in RESULT_COLUMNS} for r in rows)
    lines = ["| " + " | ".join(RESULT_COLUMNS) + " |", "|" + "---|" * len(RESULT_COLUMNS)]
    for r in rows:
        cells = [r["point"]] + [f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k))
                                for k in RESULT_COLUMNS[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    with open(os.path.join(root, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def plot_curves(rows: list[dict], root: str, metric: str = "loss") -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        recs = [x for x in _read_jsonl(os.path.join(root, r["point"], "metrics.jsonl"))
                if x["split"] == "validation"]
        ax.plot([x["step"] for x in recs], [x[metric] for x in recs], marker="o", label=r["point"])
    ax.set_xlabel("step")
    ax.set_ylabel(f"validation {metric}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = os.path.join(root, "curves.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_sweep(gin_files, specs, root, shared_bindings=(), steps=None, points=()) -> list[dict]:
    os.makedirs(root, exist_ok=True)
    todo = (grid(specs) if specs else []) + [parse_point(p) for p in points]
    if not todo:
        raise ValueError("a sweep needs at least one --sweep or --point")
    rows = [run_point(p, root, gin_files, shared_bindings, steps) for p in todo]
    write_table(rows, root)
    plot_curves(rows, root)
    return rows


def main(argv):
    del argv
    rows = run_sweep(GIN_FILES.value, SWEEP.value, WORKDIR.value, GIN_PARAMS.value, STEPS.value,
                     POINT.value)
    print(open(os.path.join(WORKDIR.value, "results.md"), encoding="utf-8").read())
    logging.info("%d points; table and curves in %s", len(rows), WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
