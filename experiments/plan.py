"""Plan a run: `python -m experiments.plan --gin_file=configs/k3.gin --mesh='fsdp=64,expert=64,tensor=4'`.

Prints total and active parameters, FLOPs per token, per-device bytes (params, optimizer state, gradients,
activation estimate) at --batch × --seq_len, and whether the sharded train step lowers:
  --lower=abstract  (default) on a device-free AbstractMesh of the planned size;
  --fake_devices=N  on a real mesh of N fake CPU devices (the process re-executes itself with
                    XLA_FLAGS=--xla_force_host_platform_device_count=N; --mesh must multiply to N);
  --lower=none      skip it.
--json prints one JSON object (keys total_params, active_params, flops_per_token, bytes_per_device,
lowers, ...). Nothing model-sized is allocated: shapes come from jax.eval_shape.
"""

import json
import math
import os
import sys
import time

from absl import app, flags

GIN_FILES = flags.DEFINE_multi_string("gin_file", ["configs/k3.gin"], "Gin config files, in order.")
GIN_PARAMS = flags.DEFINE_multi_string("gin_param", [], "Gin bindings.")
MESH = flags.DEFINE_string("mesh", "", "Mesh sizes, e.g. 'fsdp=64,expert=64,tensor=4' (axes not named "
                                       "are 1); empty: the config's MeshConfig on --devices devices.")
DEVICES = flags.DEFINE_integer("devices", 0, "Device count for -1 mesh axes (with --mesh: its product).")
BATCH = flags.DEFINE_integer("batch", 0, "Global rows per step (default: one per batch shard).")
SEQ_LEN = flags.DEFINE_integer("seq_len", 0, "Sequence length (default: DataConfig.seq_len).")
LOWER = flags.DEFINE_enum("lower", "abstract", ["abstract", "none"], "How to check lowering.")
FAKE_DEVICES = flags.DEFINE_integer("fake_devices", 0, "Lower on this many fake CPU devices instead.")
JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")


def _reexec_with_fake_devices(n: int) -> None:
    """XLA reads the device count once, before jax starts: run this command again with it set."""
    flag = f"--xla_force_host_platform_device_count={n}"
    if flag in os.environ.get("XLA_FLAGS", ""):
        return
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(),
           "JAX_PLATFORMS": "cpu"}
    os.execve(sys.executable, [sys.executable, "-m", "experiments.plan", *sys.argv[1:]], env)


def _mesh_config(config, sharding):
    if MESH.value:
        mesh_cfg = sharding.parse_mesh(MESH.value, config.mesh)
        sizes = mesh_cfg.sizes()
        devices = DEVICES.value or (math.prod(sizes.values()) if -1 not in sizes.values() else 0)
    else:
        mesh_cfg, devices = config.mesh, DEVICES.value
        if not devices and -1 not in mesh_cfg.sizes().values():
            devices = math.prod(mesh_cfg.sizes().values())
    if not devices:
        raise app.UsageError("a mesh axis is -1: give --devices=N (or a --mesh without -1)")
    return mesh_cfg, devices


def _lower(config, mesh_cfg, devices, batch, seq_len, plan_lib, sharding):
    import jax
    if FAKE_DEVICES.value:
        mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:FAKE_DEVICES.value])
        where = f"{FAKE_DEVICES.value} fake CPU devices"
    else:
        mesh = sharding.make_abstract_mesh(mesh_cfg, devices)
        where = f"AbstractMesh of {devices} devices"
    start = time.time()
    try:
        lowered = plan_lib.lower_train_step(config, mesh, batch, seq_len)
        return {"lowers": True, "lowered_on": where, "lower_seconds": round(time.time() - start, 1),
                "hlo_chars": len(lowered.as_text())}
    except Exception as err:  # noqa: BLE001 - the report says why it did not lower
        return {"lowers": False, "lowered_on": where, "lower_error": f"{type(err).__name__}: {err}"[:2000]}


def main(argv):
    del argv
    if FAKE_DEVICES.value:
        _reexec_with_fake_devices(FAKE_DEVICES.value)
    from hybridmoe import load_config, sharding
    from hybridmoe import plan as plan_lib

    config = load_config(GIN_FILES.value, GIN_PARAMS.value)
    mesh_cfg, devices = _mesh_config(config, sharding)
    if FAKE_DEVICES.value and devices != FAKE_DEVICES.value:
        raise app.UsageError(f"--mesh multiplies to {devices} devices but --fake_devices="
                             f"{FAKE_DEVICES.value}: they must be equal")
    config = config.__class__(model=config.model, data=config.data, train=config.train, mesh=mesh_cfg)
    sizes = mesh_cfg.resolve(devices)
    batch = BATCH.value or math.prod(sizes[a] for a in sharding.mesh_axes("batch", mesh_cfg.rules))
    seq_len = SEQ_LEN.value or config.data.seq_len
    report = plan_lib.plan(config, mesh_cfg, devices, batch=batch, seq_len=seq_len)
    if LOWER.value != "none" or FAKE_DEVICES.value:
        report.update(_lower(config, mesh_cfg, devices, batch, seq_len, plan_lib, sharding))
    if JSON.value:
        print(json.dumps(report))
    else:
        print(plan_lib.format_report(report))


if __name__ == "__main__":
    app.run(main)
