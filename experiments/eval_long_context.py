"""Long-context evaluation of a training run's newest checkpoint (DESIGN §3.6).

python -m experiments.eval_long_context --workdir=runs/x --lengths=512,2048,8192 \
    --depths=0,0.25,0.5,0.75,1 --num_examples=8 --out=runs/x/long_context

The run's config comes from workdir/config.gin (written by experiments.train); runs started
another way (sweep points) name their gin files and bindings with --gin_file / --gin_param.
The haystack is the run's own validation split. Writes long_context_step{N}.md, .json and .png
(exact match on a length × depth grid per task) under --out.
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from hybridmoe.config import load_config
from hybridmoe.eval import long_context as lc
from hybridmoe.train.restore import restore_state

WORKDIR = flags.DEFINE_string("workdir", None, "The training run's workdir.", required=True)
GIN_FILE = flags.DEFINE_multi_string("gin_file", [], "The run's gin files; default: "
                                                     "workdir/config.gin.")
GIN_PARAM = flags.DEFINE_multi_string("gin_param", [], "The run's gin bindings, with --gin_file.")
LENGTHS = flags.DEFINE_list("lengths", ["512", "2048", "8192"], "Prompt lengths in tokens.")
DEPTHS = flags.DEFINE_list("depths", ["0", "0.25", "0.5", "0.75", "1"],
                           "Needle depths, fractions of the context in [0, 1].")
TASKS = flags.DEFINE_list("tasks", list(lc.TASKS), f"Tasks, of: {', '.join(lc.TASKS)}.")
NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 8, "Examples per (task, length, depth).")
SEED = flags.DEFINE_integer("seed", 0, "Seed of the examples.")
MAX_BATCH_TOKENS = flags.DEFINE_integer("max_batch_tokens", 65536,
                                        "Tokens per batch: max_batch_tokens // length examples.")
OUT = flags.DEFINE_string("out", None, "Output directory; default: workdir/long_context.")


def _parse(flag: flags.FlagHolder, kind: type) -> list:
    """The flag's comma-separated items as `kind`, or an error that names the flag and the item."""
    try:
        return [kind(v) for v in flag.value]
    except ValueError as e:
        raise app.UsageError(f"--{flag.name} must be a comma-separated list of {kind.__name__} "
                             f"values, got {','.join(flag.value)!r} ({e})") from e


def main(argv):
    del argv
    lengths, depths = _parse(LENGTHS, int), _parse(DEPTHS, float)
    saved = os.path.join(WORKDIR.value, "config.gin")
    gin_files = GIN_FILE.value or [saved]
    if not os.path.isfile(gin_files[0]):
        raise app.UsageError(f"{saved} does not exist: name the run's config with --gin_file")
    config = load_config(gin_files, GIN_PARAM.value)
    _, step, state = restore_state(config, WORKDIR.value)
    logging.info("Evaluating %s at step %d: lengths %s, depths %s, tasks %s", WORKDIR.value, step,
                 lengths, depths, TASKS.value)
    cells = lc.evaluate({"params": state.params, "router": state.router}, config.model, lengths,
                        depths, TASKS.value, NUM_EXAMPLES.value, SEED.value,
                        data_config=config.data, max_batch_tokens=MAX_BATCH_TOKENS.value,
                        progress=True)
    out = OUT.value or os.path.join(WORKDIR.value, "long_context")
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"long_context_step{step}")
    meta = {"workdir": WORKDIR.value, "step": step, "num_examples": NUM_EXAMPLES.value,
            "seed": SEED.value}
    md, js = lc.write_results(cells, stem, meta)
    lc.plot_heat_map(cells, stem + ".png", f"{WORKDIR.value}, step {step}")
    print(lc.markdown_table(cells))
    print(f"wrote {md}, {js}, {stem}.png")


if __name__ == "__main__":
    app.run(main)
