"""Mixing weights of a trained AttnRes model: which sources each site reads (a heat map per run).

python -m experiments.attn_res_weights --gin_file=configs/ablations/attn_res_16l.gin \
    --point='AttnResConfig.mode="block";AttnResConfig.block_size=4' ... --sweep_dir=runs/attn_res_ablation \
    --out=benchmarks/results/attn_res_weights.png

For every point (a sweep sub-directory), the final checkpoint is run on validation batches and each
AttnResSite's softmax weights over its sources are averaged over tokens. Source 0 is the embedding;
then come block sums (block mode) or sublayer outputs (full mode), the current partial sum last.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from hybridmoe import data as data_lib
from hybridmoe.config import load_config
from hybridmoe.analysis import plot_site_weights, site_weights
from hybridmoe.sweeps import binding_string, parse_point, point_name
from hybridmoe.train.restore import restore_state

GIN_FILE = flags.DEFINE_multi_string("gin_file", [], "The sweep's gin files.")
POINT = flags.DEFINE_multi_string("point", [], "The sweep's points (as given to experiments.sweep).")
SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "The sweep's workdir.")
OUT = flags.DEFINE_string("out", "benchmarks/results/attn_res_weights.png", "Heat map path (.png); JSON beside.")
BATCHES = flags.DEFINE_integer("batches", 2, "Validation batches to average over.")


def main(argv):
    del argv
    results = {}
    for spec in POINT.value:
        point = parse_point(spec)
        if point.get("AttnResConfig.mode", "none") == "none":
            continue
        config = load_config(GIN_FILE.value, [binding_string(k, v) for k, v in point.items()])
        model, step, state = restore_state(config, os.path.join(SWEEP_DIR.value, point_name(point)))
        batches = data_lib.make_eval_batches(config.data, BATCHES.value)
        variables = {"params": state.params, "router": state.router}
        results[f"{point_name(point)} (step {step})"] = site_weights(model, variables, batches)
    plot_site_weights(results, OUT.value)
    with open(os.path.splitext(OUT.value)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump({p: {s: w.tolist() for s, w in sites.items()} for p, sites in results.items()}, f, indent=1)
    print(f"wrote {OUT.value}")


if __name__ == "__main__":
    app.run(main)
