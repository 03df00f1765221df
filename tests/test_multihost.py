"""Multi-host: flag checks and cluster detection (fast), and a real two-process run on one machine (slow).

The slow test starts `python -m experiments.train` twice with jax.distributed on 127.0.0.1 (2 processes ×
4 CPU devices, mesh data=2 × expert=2 × tensor=2), trains, checkpoints with orbax from both processes,
resumes, and checks the losses equal an uninterrupted two-process run.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from hybridmoe import distributed
from tests.train.test_training import MICRO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


def test_flags_are_all_or_nothing_and_checked():
    assert not distributed.check_flags(None, None, None)
    assert distributed.check_flags("127.0.0.1:1234", 2, 1)
    with pytest.raises(ValueError, match="--num_processes, --process_id must be given together with "
                                         "--coordinator_address"):
        distributed.check_flags("127.0.0.1:1234", None, None)
    with pytest.raises(ValueError, match="--coordinator_address must be HOST:PORT, got 'localhost'"):
        distributed.check_flags("localhost", 2, 0)
    with pytest.raises(ValueError, match=r"--process_id must be in \[0, num_processes=2\), got 2"):
        distributed.check_flags("127.0.0.1:1234", 2, 2)
    with pytest.raises(ValueError, match="--distributed must be one of"):
        distributed.initialize(mode="maybe")


def test_cluster_detection_and_single_process_default():
    assert distributed.detect_cluster(SLURM) == "slurm"
    assert distributed.detect_cluster({**SLURM, "SLURM_NTASKS": "1"}) is None  # one task: nothing to join
    assert distributed.initialize(environ={}) == "single"
    assert distributed.initialize(mode="off", environ=SLURM) == "single"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_two_processes(workdir, *extra):
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    bindings = MICRO + ["RouterConfig.name = 'quantile'", "RouterConfig.stats = 'histogram'"]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.train", "--gin_file=configs/tiny.gin", f"--workdir={workdir}",
         "--mesh=expert=2,tensor=2", "--progress=false", f"--coordinator_address=127.0.0.1:{port}",
         "--num_processes=2", f"--process_id={i}", *[f"--gin_param={b}" for b in bindings], *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=1500)[0] for p in procs]
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i}:\n{log[-4000:]}"
    return logs


def _train_losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if r["split"] == "train"]


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    _train_two_processes(straight)
    _train_two_processes(split, "--stop_after=3")
    assert [s for s, _ in _train_losses(split)] == [1, 2, 3]
    logs = _train_two_processes(split)  # resumes from the step-3 checkpoint both processes wrote
    assert all("Resumed from step 3" in log for log in logs)
    assert _train_losses(straight) == _train_losses(split)
    assert sorted(os.listdir(os.path.join(split, "checkpoints")))[-1] == "6"
