"""Train a model: `python -m experiments.train --gin_file=configs/tiny.gin --workdir=runs/tiny`.

Restarting in an existing workdir resumes from its newest checkpoint; Ctrl-C saves and stops.
A context-length curriculum runs its stages in order from the one command (and resumes mid-stage):
`--gin_file=configs/stages/tiny_ramp.gin` trains at 512, then 2K, then 8K tokens on the CPU.

Several processes (docs/scaling.md): run the same command in each, with
--coordinator_address=HOST:PORT --num_processes=N --process_id=I, or with nothing more under SLURM and on
Cloud TPU VMs (detected; --distributed=on asks JAX to detect any cluster it knows, off never starts it).
--mesh='fsdp=4,tensor=2' sets MeshConfig sizes (axes not named keep their gin values).
"""

import os

from absl import app, flags, logging

from hybridmoe import distributed
from hybridmoe.config import load_config_and_text
from hybridmoe.sharding import parse_mesh_sizes
from hybridmoe.train.loop import train

FLAGS = flags.DEFINE_multi_string("gin_file", ["configs/tiny.gin"], "Gin config files, in order.")
PARAMS = flags.DEFINE_multi_string("gin_param", [], "Gin bindings, e.g. 'KDAConfig.g_min = -4.0'.")
WORKDIR = flags.DEFINE_string("workdir", "runs/tiny", "Checkpoints, metrics and the config go here.")
PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
MESH = flags.DEFINE_string("mesh", "", "Mesh axis sizes, e.g. 'fsdp=4,tensor=2' (MeshConfig bindings).")
STOP_AFTER = flags.DEFINE_integer("stop_after", 0, "Stop (with a checkpoint) after this many steps in "
                                                   "this call; 0: train to TrainConfig.steps.")
COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's coordinator.")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
DISTRIBUTED = flags.DEFINE_enum("distributed", "auto", list(distributed.MODES),
                                "auto: start jax.distributed from the flags above or a detected SLURM / "
                                "Cloud TPU environment; on: always (JAX detects the cluster); off: never.")


def main(argv):
    del argv
    distributed.initialize(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value,
                           mode=DISTRIBUTED.value)
    mesh = [f"MeshConfig.{axis} = {size}" for axis, size in parse_mesh_sizes(MESH.value).items()]
    config, text = load_config_and_text(FLAGS.value, PARAMS.value + mesh)
    os.makedirs(WORKDIR.value, exist_ok=True)
    with open(os.path.join(WORKDIR.value, "config.gin"), "w", encoding="utf-8") as f:
        f.write(text)
    logging.info("Training %s in %s", FLAGS.value, WORKDIR.value)
    result = train(config, WORKDIR.value, progress=PROGRESS.value, stop_after=STOP_AFTER.value or None)
    if result.interrupted:
        logging.warning("Interrupted at step %d; rerun the same command to resume.", result.step)


if __name__ == "__main__":
    app.run(main)
