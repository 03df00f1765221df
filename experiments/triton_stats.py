r"""Registers, spills and shared memory of each Pallas KDA kernel as compiled for an H100/H200 (sm_90a), without a GPU.

  PYTHONPATH=TRITON_SITE python -m experiments.triton_stats --shape=1x1024x16x128 --gates=bounded,unbounded \
      --tuning="state_tile=16,intra_warps=4" --kernels=state --keep_dir=/tmp/kda_triton

TRITON_SITE is a directory holding the `triton` package (3.6; e.g. `pip install --no-deps --target TRITON_SITE
triton-3.6.0-*.whl`), kept out of .venv: only this script needs it. For each gate, jax.jit of the value and gradient
of sum(o * do) through kda_pallas (the function behind chunk_kda(backend="pallas"), called directly so that --tuning
reaches it) is lowered for CUDA against an abstract H100 device: each pallas_call becomes a `__gpu$xla.gpu.triton`
custom call whose backend_config holds the kernel's Triton IR (MLIR bytecode) with its num_warps and num_stages.
Each kernel is compiled by `triton` for GPUTarget("cuda", 90, 32) in a child process (a Triton crash or a compile
past --compile_timeout costs one row), then `ptxas -v --gpu-name=sm_90a` (the ptxas Triton uses, or --ptxas) reports
registers, spills and stack; shared is Triton's dynamic shared memory plus ptxas's static smem. wgmma and mma.sync
are instruction counts in the PTX (static, not executed), tt.dot the dots in the Triton IR; compile s is
triton.compile from TTIR to cubin (its own ptxas run included). A kernel with the same IR and launch parameters as one
of an earlier gate is not compiled again: its time reads `= GATE`, and its files (--keep_dir) are under that gate.

On a GPU, XLA compiles the same IR with its own Triton revision and pass pipeline, so these numbers estimate what runs
there; they are exact for the IR under this Triton. --shape, --gates and the Tuning parser are those of
experiments.profile_kda.
"""

import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments.bench_kda import G_MIN
from experiments.profile_kda import parse_tuning  # also defines --shape, --gates and (bench_kda's) --tuning

FLAGS = flags.FLAGS
flags.declare_key_flag("shape")
flags.declare_key_flag("gates")
flags.declare_key_flag("tuning")
FLAGS.set_default("shape", "1x1024x16x128")
flags.DEFINE_integer("chunk_size", 64, "chunk_kda's chunk_size.")
flags.DEFINE_list("kernels", [], "Only kernels whose name contains one of these substrings (empty: all).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "dtype of q, k, v and beta (g is fp32).")
flags.DEFINE_bool("forward_only", False, "Lower the forward alone (no backward): the inference forward's kernels.")
flags.DEFINE_string("keep_dir", "", "Keep each kernel's TTIR, TTGIR, LLVM IR, PTX, cubin and ptxas log in DIR/GATE/.")
flags.DEFINE_string("ptxas", "", "ptxas binary (empty: the one Triton uses: $TRITON_PTXAS_PATH, else its bundled one).")
flags.DEFINE_integer("compile_timeout", 600, "Seconds one kernel's compile (Triton + ptxas) may take.")
flags.DEFINE_string("compile_worker", "", "Internal: compile the kernel of this job file, write JOB.out and exit.")
flags.DEFINE_string("triton_python", "", "Python interpreter that has `triton` (and numpy, absl) for the compile "
                    "children, when this one cannot import it (the wheels are per Python version); empty: this one "
                    "with PYTHONPATH=TRITON_SITE. Needs --ptxas.")

CAPABILITY = 90  # H100 / H200
GPU_ARCH = "sm_90a"
ABSTRACT_DEVICE_KIND = "NVIDIA H100"  # any kind jax's pallas gpu_info maps to compute capability 9.0
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"
MAX_SHARED_BYTES = 232448  # sm_90 opt-in shared memory per block (227 KiB)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    num_warps: int
    num_stages: int
    ttir: str  # Triton IR as MLIR text


# ---------------------------------------------------------------------------------------------------------------
# Lowering and extraction (parent process; JAX only).


def kda_value_and_grad(tuning, g_min, chunk_size, forward_only=False):
    """value_and_grad of sum(o * do) in q, k, v, g, beta, with the Pallas kernels at this tuning (forward_only: the
    value alone, i.e. the inference forward's kernels)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.kda import api
    from pallas_kernels.kda.pallas_op import kda_pallas

    run = api._whole_chunks(functools.partial(kda_pallas, tuning=tuning))
    diagonal = api.kda_diagonal_path(g_min, chunk_size)

    def loss(q, k, v, g, beta, do):
        batch, _, heads, dim = q.shape
        initial_state = jnp.zeros((batch, heads, dim, dim), jnp.float32)
        o, _ = run(q, k, v, g, beta, initial_state, None, scale=dim ** -0.5, chunk_size=chunk_size,
                   diagonal=diagonal)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    return loss if forward_only else jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))


def lower_for_cuda(fn, shape):
    """The StableHLO module (an ir.Module) of jax.jit(fn) lowered for CUDA on an abstract H100, no GPU needed."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh

    batch, seq_len, heads, dim = shape
    dtype = jnp.dtype(FLAGS.dtype)
    tokens = jax.ShapeDtypeStruct((batch, seq_len, heads, dim), dtype)
    gate = jax.ShapeDtypeStruct((batch, seq_len, heads, dim), jnp.float32)
    beta = jax.ShapeDtypeStruct((batch, seq_len, heads), dtype)
    device = AbstractDevice(device_kind=ABSTRACT_DEVICE_KIND, num_cores=132, platform="gpu")
    # Pallas's Triton lowering reads the target's compute capability from the abstract mesh's device.
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        lowered = jax.jit(fn).trace(tokens, tokens, tokens, gate, beta, tokens).lower(lowering_platforms=("cuda",))
    return lowered.compiler_ir("stablehlo")


def triton_kernels(module):
    """Kernels of every Triton custom call in a StableHLO module, in program order, identical ones once."""
    from jax._src.interpreters import mlir
    from jax._src.lib import triton as triton_lib
    from jax._src.lib.mlir import ir

    context = ir.Context()
    context.append_dialect_registry(mlir.upstream_dialects)
    triton_lib.dialect.register_dialect(context)
    context.load_all_available_dialects()

    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if (child.name == "stablehlo.custom_call"
                            and ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_CALL_TARGET):
                        calls.append(child)
                    walk(child)

    walk(module.operation)
    kernels, names = [], set()
    for call in calls:
        config = call.attributes["mhlo.backend_config"]
        config = {config[i].name: config[i].attr for i in range(len(config))}
        with context:
            ttir = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
        kernel = Kernel(ir.StringAttr(config["name"]).value, ir.IntegerAttr(config["num_warps"]).value,
                        ir.IntegerAttr(config["num_stages"]).value, ttir.operation.get_asm(enable_debug_info=True))
        if kernel in kernels:
            continue
        if kernel.name in names:  # the same pallas_call name with other IR or launch parameters
            kernel = dataclasses.replace(kernel, name=f"{kernel.name}_{len(kernels)}")
        names.add(kernel.name)
        kernels.append(kernel)
    return kernels


# ---------------------------------------------------------------------------------------------------------------
# Compiling one kernel (child process; Triton only).


def compile_worker(job_path):
    """Compiles job["ttir"] with Triton, runs ptxas -v on the PTX, writes the numbers (or the error) to JOB.out."""
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = compile_and_measure(**job)
    except Exception as err:  # reported in the kernel's row; the parent goes on with the next kernel
        result = dict(error=f"{type(err).__name__}: {err}")
    with open(job_path + ".out", "w") as f:
        json.dump(result, f)


def compile_and_measure(ttir, num_warps, num_stages, ptxas, prefix):
    import triton
    from triton.backends.compiler import GPUTarget

    start = time.perf_counter()
    compiled = triton.compile(ttir, target=GPUTarget("cuda", CAPABILITY, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    seconds = time.perf_counter() - start
    for stage in ("ttgir", "llir", "ptx"):
        with open(f"{prefix}.{stage}", "w") as f:
            f.write(compiled.asm[stage])
    # The same options as Triton's own ptxas call (backends/nvidia/compiler.py, make_cubin), which drops its log.
    command = [ptxas, "-lineinfo", "-v", f"--gpu-name={GPU_ARCH}", f"{prefix}.ptx", "-o", f"{prefix}.cubin"]
    if not compiled.metadata.enable_fp_fusion:
        command.insert(1, "--fmad=false")
    log = subprocess.run(command, check=True, capture_output=True, text=True).stderr
    with open(f"{prefix}.ptxas.log", "w") as f:
        f.write(log)
    ptx = compiled.asm["ptx"]
    return dict(**ptxas_usage(log, compiled.metadata.name), dynamic_shared=compiled.metadata.shared,
                wgmma=len(re.findall(r"^\s*(?:@%p\d+\s+)?wgmma\.mma_async", ptx, re.M)),
                mma_sync=len(re.findall(r"^\s*(?:@%p\d+\s+)?mma\.sync", ptx, re.M)), seconds=seconds)


def ptxas_usage(log, entry):
    """Registers, spills, stack and static shared memory of one entry function from a `ptxas -v` log."""
    start = log.find(f"Compiling entry function '{entry}'")
    if start < 0:
        raise ValueError(f"no entry function {entry!r} in the ptxas log:\n{log}")
    part = log[start:]
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", part)
    registers = re.search(r"Used (\d+) registers", part)
    smem = re.search(r"(\d+) bytes smem", part)
    if not (frame and registers):
        raise ValueError(f"cannot read the resource usage of {entry!r} from the ptxas log:\n{log}")
    return dict(registers=int(registers[1]), stack=int(frame[1]), spill_stores=int(frame[2]),
                spill_loads=int(frame[3]), static_shared=int(smem[1]) if smem else 0)


def compile_kernel(kernel, directory, ptxas, env):
    """Runs compile_worker on one kernel in a child process; its result dict (with "error" if it failed)."""
    prefix = os.path.join(directory, kernel.name)
    with open(prefix + ".ttir", "w") as f:
        f.write(kernel.ttir)
    job_path = prefix + ".job.json"
    with open(job_path, "w") as f:
        json.dump(dict(ttir=prefix + ".ttir", num_warps=kernel.num_warps, num_stages=kernel.num_stages,
                       ptxas=ptxas, prefix=prefix), f)
    command = [FLAGS.triton_python or sys.executable, "-m", "experiments.triton_stats",
               f"--compile_worker={job_path}"]
    start = time.perf_counter()
    # Its own process group, so that a timeout also ends the ptxas it may be running.
    child = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        log, _ = child.communicate(timeout=FLAGS.compile_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return dict(error=f"compile timed out after {FLAGS.compile_timeout} s")
    finally:
        os.remove(job_path)
    tail = "\n".join(log.strip().splitlines()[-15:])
    if child.returncode or not os.path.exists(job_path + ".out"):
        return dict(error=f"compile child exited with {child.returncode} after {time.perf_counter() - start:.0f} s:\n"
                          + tail)
    with open(job_path + ".out") as f:
        result = json.load(f)
    os.remove(job_path + ".out")
    if "error" in result and tail:
        result["error"] += "\n" + tail  # e.g. MLIR's diagnostics, printed by the child
    return result


# ---------------------------------------------------------------------------------------------------------------
# The table.

COLUMNS = ("gate", "kernel", "warps", "stages", "regs", "spill st/ld B", "stack B", "shared B", "tt.dot", "wgmma",
           "mma.sync", "compile s")


def table_row(gate, kernel, result):
    head = [gate, kernel.name, str(kernel.num_warps), str(kernel.num_stages)]
    if "error" in result:
        return head + ["failed"] + [""] * (len(COLUMNS) - len(head) - 1)
    shared = result["dynamic_shared"] + result["static_shared"]
    return head + [str(result["registers"]), f"{result['spill_stores']}/{result['spill_loads']}", str(result["stack"]),
                   f"{shared}" + (" (> 227 KiB)" if shared > MAX_SHARED_BYTES else ""),
                   str(len(re.findall(r"= tt\.dot ", kernel.ttir))), str(result["wgmma"]), str(result["mma_sync"]),
                   f"= {result['same_as']}" if "same_as" in result else f"{result['seconds']:.1f}"]


def markdown_line(cells):
    return "| " + " | ".join(cells) + " |"


def import_triton():
    try:
        import triton
        from triton.backends.nvidia import compiler  # noqa: F401  (the CUDA backend)
    except ImportError as err:
        raise SystemExit(f"experiments.triton_stats needs the `triton` package (3.6) with its NVIDIA backend: "
                         f"`pip install --no-deps --target DIR triton-3.6.0-*.whl` and run with PYTHONPATH=DIR "
                         f"({type(err).__name__}: {err})") from None
    if not triton.__version__.startswith("3.6"):
        print(f"warning: triton {triton.__version__}, not 3.6: it may not parse the IR of this jax's Triton dialect",
              flush=True)
    return triton


def resolve_ptxas():
    """(path, version line) of the ptxas to use: --ptxas, else the one Triton resolves."""
    if FLAGS.ptxas:
        path = shutil.which(FLAGS.ptxas) or FLAGS.ptxas
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise SystemExit(f"--ptxas={FLAGS.ptxas}: not an executable file")
    else:
        from triton import knobs
        try:
            path = knobs.nvidia.ptxas.path
        except RuntimeError as err:
            raise SystemExit(f"no ptxas: Triton found none ({err}); pass --ptxas or set TRITON_PTXAS_PATH") from None
    version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    return path, version.strip().splitlines()[-1]


def main(argv):
    del argv
    if FLAGS.compile_worker:
        compile_worker(FLAGS.compile_worker)
        return
    # Importing profile_kda (and through it bench_kda) defines their flags too; only --shape, --gates and --tuning
    # count here.
    foreign = [f.name for module in ("experiments.profile_kda", "experiments.bench_kda")
               for f in FLAGS.flags_by_module_dict().get(module, ())
               if f.present and f.name not in ("shape", "gates", "tuning")]
    if foreign:
        raise app.UsageError(f"--{', --'.join(foreign)}: flags of other experiments, unused here (see --help)")
    bad_gates = set(FLAGS.gates) - {"bounded", "unbounded"}
    if bad_gates:
        raise app.UsageError(f"--gates: unknown {sorted(bad_gates)}; allowed: bounded, unbounded")
    try:
        shape = tuple(int(s) for s in FLAGS.shape.split("x"))
        if len(shape) != 4:
            raise ValueError
    except ValueError:
        raise app.UsageError(f"--shape must be BxTxHxD, got {FLAGS.shape!r}") from None
    try:
        tuning = parse_tuning(FLAGS.tuning)
    except ValueError as err:
        raise app.UsageError(f"--tuning={FLAGS.tuning!r}: {err}") from None

    if FLAGS.triton_python:
        if not FLAGS.ptxas:
            raise app.UsageError("--triton_python needs --ptxas (e.g. triton/backends/nvidia/bin/ptxas of that Python)")
        found = subprocess.run([FLAGS.triton_python, "-c", "import os, triton; print(triton.__version__, "
                                "os.path.dirname(triton.__file__))"], capture_output=True, text=True)
        if found.returncode:
            raise app.UsageError(f"--triton_python={FLAGS.triton_python} cannot import triton:\n{found.stderr}")
        triton_version, triton_dir = found.stdout.split()
    else:
        triton = import_triton()
        triton_version, triton_dir = triton.__version__, os.path.dirname(triton.__file__)
    ptxas, ptxas_version = resolve_ptxas()
    import jax
    print(f"jax {jax.__version__}; triton {triton_version} ({triton_dir}); "
          f"ptxas {ptxas} ({ptxas_version}); target {GPU_ARCH}", flush=True)
    print(f"shape {FLAGS.shape} (BxTxHxD), chunk {FLAGS.chunk_size}, {tuning}", flush=True)

    scratch = tempfile.mkdtemp(prefix="triton_stats_")
    # A fresh Triton cache: every compile is timed from scratch and nothing lands in ~/.triton.
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(scratch, "cache"), TRITON_PTXAS_PATH=ptxas)
    failures = 0
    compiled = {}  # Kernel -> (gate, result)
    try:
        header_printed = False
        for gate in FLAGS.gates:
            start = time.perf_counter()
            g_min = G_MIN if gate == "bounded" else None
            module = lower_for_cuda(kda_value_and_grad(tuning, g_min, FLAGS.chunk_size, FLAGS.forward_only), shape)
            kernels = triton_kernels(module)
            found = [k.name for k in kernels]
            if FLAGS.kernels:
                kernels = [k for k in kernels if any(part in k.name for part in FLAGS.kernels)]
            print(f"{gate}: lowered in {time.perf_counter() - start:.1f} s; kernels {', '.join(found)}"
                  + (f"; compiling {len(kernels)} matching --kernels" if FLAGS.kernels else ""), flush=True)
            directory = os.path.join(FLAGS.keep_dir or scratch, gate)
            os.makedirs(directory, exist_ok=True)
            for kernel in kernels:
                if kernel in compiled:  # the same IR and launch parameters under an earlier gate: not compiled again
                    result = dict(compiled[kernel][1], same_as=compiled[kernel][0])
                else:
                    result = compile_kernel(kernel, directory, ptxas, env)
                    compiled[kernel] = (gate, result)
                if not header_printed:
                    print(markdown_line(COLUMNS) + "\n|" + "---|" * len(COLUMNS), flush=True)
                    header_printed = True
                print(markdown_line(table_row(gate, kernel, result)), flush=True)
                if "error" in result:
                    failures += 1
                    print(f"  {gate} {kernel.name}: {result['error']}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if FLAGS.keep_dir:
        print(f"IR, PTX and ptxas logs in {FLAGS.keep_dir}/GATE/", flush=True)
    if failures:
        raise SystemExit(f"{failures} kernel(s) failed to compile")


if __name__ == "__main__":
    app.run(main)
