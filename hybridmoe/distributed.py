"""Multi-host start-up (DESIGN §3.7): `jax.distributed.initialize` from flags or the cluster environment.

No home-made launcher: every process runs the same command, and JAX's own runtime connects them.
  - explicit: --coordinator_address=HOST:PORT --num_processes=N --process_id=I (any machines, or several
    processes on one machine for tests);
  - SLURM (srun with more than one task) and Cloud TPU VMs: `jax.distributed.initialize()` with no
    arguments, which reads the coordinator, process count and id from the environment / TPU metadata;
  - otherwise a single process: nothing to initialise.
After start-up every process sees all devices (`jax.devices()`), the loop builds one global mesh, each
process feeds its own rows (`jax.process_index()` of `jax.process_count()` data shards) and orbax
writes and reads checkpoints of the global arrays from every process.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Mapping

import jax
from absl import logging

MODES = ("auto", "on", "off")


def detect_cluster(environ: Mapping[str, str] = os.environ) -> str | None:
    """'slurm' or 'tpu' when JAX can find the coordinator by itself, else None.

    SLURM: the variables JAX's SLURM cluster reads, with more than one task. TPU: a Cloud TPU VM
    (libtpu installed and TPU device files present); JAX asks the TPU metadata server for the rest.
    """
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in environ for v in slurm) and int(environ["SLURM_NTASKS"]) > 1:
        return "slurm"
    if importlib.util.find_spec("libtpu") is not None and (glob.glob("/dev/accel*")
                                                            or glob.glob("/dev/vfio/[0-9]*")):
        return "tpu"
    return None


def check_flags(coordinator_address: str | None, num_processes: int | None,
                process_id: int | None) -> bool:
    """True when explicit flags are given (then all three must be, and consistent); False for none."""
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
             "process_id": process_id}
    if all(v is None for v in given.values()):
        return False
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"--{', --'.join(missing)} must be given together with "
                         f"--{', --'.join(k for k in given if k not in missing)}")
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator_address must be HOST:PORT, got {coordinator_address!r}")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"--num_processes must be a positive integer, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"--process_id must be in [0, num_processes={num_processes}), got {process_id!r}")
    return True


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, mode: str = "auto",
               environ: Mapping[str, str] = os.environ) -> str:
    """Starts JAX's distributed runtime if this is a multi-process run; returns how it started:
    "flags", "slurm", "tpu", "environment" (mode="on": JAX's own detection) or "single".

    Must run before anything touches a JAX device. mode="off" never initialises (even under SLURM).
    """
    if mode not in MODES:
        raise ValueError(f"--distributed must be one of {MODES}, got {mode!r}")
    if check_flags(coordinator_address, num_processes, process_id):
        if mode == "off":
            raise ValueError("--distributed=off contradicts --coordinator_address, --num_processes and "
                             "--process_id")
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
        how = "flags"
    elif mode == "off":
        return "single"
    else:
        how = detect_cluster(environ) or ("environment" if mode == "on" else None)
        if how is None:
            return "single"
        jax.distributed.initialize()
    logging.info("jax.distributed started (%s): process %d of %d, %d local / %d global devices", how,
                 jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
    return how
