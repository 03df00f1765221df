"""Train a model: `python -m experiments.train --gin_file=configs/tiny.gin --workdir=runs/tiny`.

Restarting in an existing workdir resumes from its newest checkpoint; Ctrl-C saves and stops.
"""

import os

import gin
from absl import app, flags, logging

from hybridmoe import load_config
from hybridmoe.train.loop import train

FLAGS = flags.DEFINE_multi_string("gin_file", ["configs/tiny.gin"], "Gin config files, in order.")
PARAMS = flags.DEFINE_multi_string("gin_param", [], "Gin bindings, e.g. 'KDAConfig.g_min = -4.0'.")
WORKDIR = flags.DEFINE_string("workdir", "runs/tiny", "Checkpoints, metrics and the config go here.")
PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv):
    del argv
    config = load_config(FLAGS.value, PARAMS.value)
    os.makedirs(WORKDIR.value, exist_ok=True)
    with open(os.path.join(WORKDIR.value, "config.gin"), "w", encoding="utf-8") as f:
        f.write(gin.config_str())
    logging.info("Training %s in %s", FLAGS.value, WORKDIR.value)
    result = train(config, WORKDIR.value, progress=PROGRESS.value)
    if result.interrupted:
        logging.warning("Interrupted at step %d; rerun the same command to resume.", result.step)


if __name__ == "__main__":
    app.run(main)
