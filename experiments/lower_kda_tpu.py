"""Lowers chunk_kda's Mosaic TPU kernels (backend "pallas_tpu") for TPU targets from any machine, and reports each
kernel's grid, blocks, VMEM per grid step and HBM traffic, with the traffic's time at the chip's bandwidth.

  python -m experiments.lower_kda_tpu --out=benchmarks/results/kda_tpu_lowering.md

Pallas' TPU lowering runs in JAX itself, so this needs no TPU: it proves the kernels trace and lower (block tiling
legal: last two block dims multiples of 8 and 128 or the array's own). It does not run the TPU compiler's own passes
(libtpu, on a TPU only) and times nothing: the "floor" column is traffic / HBM bandwidth, a lower bound, not a
measurement.
"""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax._src import tpu_info

from pallas_kernels.kda.pallas_tpu import kda_pallas_tpu

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["1x8192x16x128", "1x32768x16x128", "4x8192x16x128", "1x131072x16x128"],
                  "B x T x H x D (K = V = D, HV = H) to lower.")
flags.DEFINE_list("targets", ["TPU v5 lite", "TPU v6 lite", "TPU v5"], "TPU device kinds to lower for.")
flags.DEFINE_integer("chunk", 64, "chunk_size.")
flags.DEFINE_string("out", "", "Also write the markdown report here.")


@dataclasses.dataclass
class KernelInfo:
    name: str
    grid: tuple
    blocks: list  # (block shape, dtype, fetches)
    scratch_bytes: int

    @property
    def vmem_bytes(self):
        """Blocks double-buffered by the pipeline, plus scratch."""
        return 2 * sum(_nbytes(shape, dtype) for shape, dtype, _ in self.blocks) + self.scratch_bytes

    @property
    def hbm_bytes(self):
        return sum(_nbytes(shape, dtype) * fetches for shape, dtype, fetches in self.blocks)


def _nbytes(shape, dtype):
    return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


def _args(batch, seq_len, heads, dim):
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    return [s((batch, seq_len, heads, dim), bf16)] * 3 + [s((batch, seq_len, heads, dim), jnp.float32),
                                                          s((batch, seq_len, heads), bf16),
                                                          s((batch, heads, dim, dim), jnp.float32)]


def _loss(diagonal, dim, chunk):
    def loss(q, k, v, g, beta, s0):
        o, state = kda_pallas_tpu(q, k, v, g, beta, s0, None, scale=dim ** -0.5, chunk_size=chunk,
                                  diagonal=diagonal)
        return o.astype(jnp.float32).sum() + state.sum()

    return jax.grad(loss, argnums=tuple(range(6)))


def _block_shape(mapping):
    """Block dims as ints (a squeezed dim is 1)."""
    return tuple(d if isinstance(d, int) else getattr(d, "block_size", 1) for d in mapping.block_shape)


def _fetches(mapping, grid):
    """Grid steps at which the block's index changes (consecutive steps with the same index reuse the buffer): all
    steps, or the steps of the outer axes when the index does not depend on the innermost one."""
    steps = int(np.prod(grid))
    if len(grid) and grid[-1] > 1:
        at = lambda *ids: [int(v) for v in jax.core.eval_jaxpr(mapping.index_map_jaxpr, (),  # noqa: E731
                                                              *map(jnp.int32, ids))]
        if at(*[0] * len(grid)) == at(*[0] * (len(grid) - 1), 1):
            return steps // grid[-1]
    return steps


def kernels_of(fn, args):
    """KernelInfo of every pallas_call in fn's jaxpr (recursing into custom_vjp and pjit bodies)."""
    out = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                gm = eqn.params["grid_mapping"]
                grid = tuple(int(g) for g in gm.grid)
                blocks = [(_block_shape(bm), bm.array_aval.dtype, _fetches(bm, grid)) for bm in gm.block_mappings]
                scratch = sum(_nbytes(a.shape, a.dtype) for a in gm.scratch_avals)
                out.append(KernelInfo(eqn.params["name"] if "name" in eqn.params else
                                      eqn.params["debug_info"].func_name, grid, blocks, scratch))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def lower(fn, args, kind):
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        try:
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
            info = tpu_info.get_tpu_info()
            return f"lowered ({text.count('tpu_custom_call')} kernels)", info
        except Exception as e:  # noqa: BLE001 -- reported, not hidden
            return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}", None


def main(argv):
    del argv
    lines = [f"# chunk_kda(backend='pallas_tpu'): lowering for Mosaic TPU", "",
             f"jax {jax.__version__}; lowered on {jax.devices()[0].platform} for each target through "
             "`jax.sharding.use_abstract_mesh` (no TPU attached). bf16 q/k/v/beta, fp32 g, K = V = D, HV = H, "
             f"chunk {FLAGS.chunk}, forward + backward (`jax.grad`). **Nothing here is a TPU timing**: the floor is "
             "each kernel's HBM traffic at the chip's bandwidth, a lower bound. VMEM per step: the kernel's blocks "
             "double-buffered plus its scratch.", ""]
    for shape in FLAGS.shapes:
        batch, seq_len, heads, dim = map(int, shape.split("x"))
        args = _args(batch, seq_len, heads, dim)
        for gate, diagonal in (("bounded", ("dense", 16)), ("unbounded", ("pairwise", 16))):
            fn = _loss(diagonal, dim, FLAGS.chunk)
            start = len(lines)
            lines.append(f"## B={batch} T={seq_len} H={heads} D={dim}, {gate}")
            lines.append("")
            infos = {}
            for kind in FLAGS.targets:
                status, infos[kind] = lower(fn, args, kind)
                lines.append(f"- {kind}: {status}")
            lines.append("")
            kernels = kernels_of(fn, args)
            chips = [k for k in FLAGS.targets if infos[k] is not None]
            lines.append("| kernel | grid | VMEM / step | HBM traffic | " +
                         " | ".join(f"floor {k}" for k in chips) + " |")
            lines.append("|---|---|---|---|" + "---|" * len(chips))
            total = 0
            for kern in kernels:
                total += kern.hbm_bytes
                floors = [f"{kern.hbm_bytes / infos[k].mem_bw_bytes_per_second * 1e3:.3f} ms" for k in chips]
                lines.append(f"| {kern.name} | {'x'.join(map(str, kern.grid))} | {kern.vmem_bytes / 2**20:.2f} MiB "
                             f"| {kern.hbm_bytes / 2**20:.1f} MiB | " + " | ".join(floors) + " |")
            floors = [f"{total / infos[k].mem_bw_bytes_per_second * 1e3:.3f} ms" for k in chips]
            lines.append(f"| all | | | {total / 2**20:.1f} MiB | " + " | ".join(floors) + " |")
            if chips:
                vmem = ", ".join(f"{k} {infos[k].vmem_capacity_bytes / 2**20:.0f} MiB" for k in chips)
                lines.append(f"\nVMEM per core: {vmem}.")
            lines.append("")
            print("\n".join(lines[start:]), flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    app.run(main)
