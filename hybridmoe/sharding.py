"""Sharding (DESIGN §3.7): the device mesh, logical-axis rules -> shardings, expert parallelism.

Parameters carry logical axis names (`nn.with_logical_partitioning`); `MeshConfig.rules` maps them to the
mesh axes (data, fsdp, expert, tensor, sequence), flax semantics (first free rule wins). From the rules:
  - the train state: params, and every optimizer leaf shaped like a param, get the param's sharding (FSDP
    over `fsdp`; heads, expert widths and vocab over `tensor`; experts over `expert`); all else replicated;
  - the batch: rows over the "batch" axes, positions over the "length" axes;
  - the MoE layer's expert parallelism (`ExpertParallel`): route -> all_to_all -> local experts -> psum of
    tensor-parallel partial sums -> all_to_all back -> combine, inside one `jax.shard_map`;
  - context parallelism of the attention layers over the "length" axes (hybridmoe.context_parallel).
A mesh axis that does not divide a parameter dimension is dropped from that dimension (the parameter is then
replicated along it: norm vectors, a 259-token byte vocabulary over tensor=2); `replicated_params` lists them.
Batch dimensions are never fitted that way: a batch that does not divide is an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from hybridmoe.config import MESH_AXES, MeshConfig

AUTO = jax.sharding.AxisType.Auto


# ------------------------------------------------------------------------------------------------ meshes

def parse_mesh_sizes(text: str) -> dict[str, int]:
    """'fsdp=64,expert=64,tensor=4' -> {"fsdp": 64, "expert": 64, "tensor": 4} (the axes named)."""
    sizes = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in MESH_AXES or not value.lstrip("-").isdigit():
            raise ValueError(f"--mesh entry {part!r} must look like AXIS=SIZE with AXIS in {MESH_AXES}")
        sizes[name] = int(value)
    return sizes


def parse_mesh(text: str, base: MeshConfig | None = None) -> MeshConfig:
    """'fsdp=64,expert=64,tensor=4' -> MeshConfig; axes not named are 1, `base` gives the rules."""
    sizes = {axis: 1 for axis in MESH_AXES} | parse_mesh_sizes(text)
    return dataclasses.replace(base or MeshConfig(), **sizes)


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The named mesh over `devices` (default: every device of every process), all axes Auto."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = config.resolve(len(devices))
    return jax.make_mesh(tuple(sizes.values()), MESH_AXES, axis_types=(AUTO,) * len(MESH_AXES),
                         devices=devices)


def make_abstract_mesh(config: MeshConfig, num_devices: int) -> AbstractMesh:
    """A device-free mesh of `num_devices` (for planning and lowering without the devices)."""
    sizes = config.resolve(num_devices)
    return AbstractMesh(tuple(sizes.values()), MESH_AXES, axis_types=(AUTO,) * len(MESH_AXES))


def axis_sizes(mesh: Mesh | AbstractMesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


# ------------------------------------------------------------------------------------ rules -> specs

def mesh_axes(logical: str, rules) -> tuple[str, ...]:
    """Mesh axes of the first rule for `logical` (() when there is none or it maps to None)."""
    for name, axes in rules:
        if name == logical:
            return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return ()


def _entry(axes: Sequence[str]):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def logical_to_spec(names: Sequence[str | None], rules) -> P:
    """Logical names of one array -> PartitionSpec, through flax's rule matching.

    A name repeated in one array (KDA's w_f_up: head_dim, heads, head_dim) is kept only at its first
    position: flax refuses repeats, and one mesh axis can shard one dimension anyway.
    """
    seen: set[str] = set()
    unique = []
    for name in names:
        unique.append(None if name in seen else name)
        if name is not None:
            seen.add(name)
    return nn.logical_to_mesh_axes(tuple(unique), rules)


def fit_spec(spec: P, shape: Sequence[int], sizes: Mapping[str, int]) -> P:
    """Drops from each dimension the mesh axes that would not divide it (given the ones kept before)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    fitted = []
    for dim, entry in zip(shape, entries):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept: list[str] = []
        for axis in axes:
            if dim % (math.prod(sizes[a] for a in kept) * sizes[axis]) == 0:
                kept.append(axis)
        fitted.append(_entry(kept))
    return P(*fitted)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def param_specs(boxed_params: Any, rules, sizes: Mapping[str, int]) -> Any:
    """Boxed (logically partitioned) params or their eval_shape -> tree of mesh PartitionSpecs."""
    logical = nn.get_partition_spec(boxed_params)
    shapes = nn.meta.unbox(boxed_params)
    return jax.tree.map(lambda spec, x: fit_spec(logical_to_spec(tuple(spec), rules), x.shape, sizes),
                        logical, shapes, is_leaf=_is_spec)


def _path_names(path) -> tuple[str, ...]:
    return tuple(jax.tree_util.keystr((key,)) for key in path)


def specs_like_params(tree: Any, params: Any, specs: Any) -> Any:
    """Specs for an optimizer state: a leaf whose path ends with a param's path, at the param's shape,
    gets the param's spec (Adam moments, Muon momenta); any other leaf is replicated (counts, scalars)."""
    by_path = {_path_names(path): (x.shape, spec) for (path, x), spec in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(specs, is_leaf=_is_spec))}

    def pick(path, leaf):
        names = _path_names(path)
        for start in range(len(names)):
            hit = by_path.get(names[start:])
            if hit is not None and tuple(hit[0]) == tuple(leaf.shape):
                return hit[1]
        return P()

    return jax.tree_util.tree_map_with_path(pick, tree)


def replicated_params(boxed_params: Any, rules, sizes: Mapping[str, int]) -> list[str]:
    """Params whose rules asked for a mesh axis that `fit_spec` had to drop (for the planner's report)."""
    logical = nn.get_partition_spec(boxed_params)
    shapes = nn.meta.unbox(boxed_params)
    out = []
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(shapes)[0],
                               jax.tree.leaves(logical, is_leaf=_is_spec)):
        wanted = logical_to_spec(tuple(spec), rules)
        if fit_spec(wanted, x.shape, sizes) != fit_spec(wanted, x.shape, {k: 1 for k in sizes}):
            out.append(jax.tree_util.keystr(path))
    return out


# ------------------------------------------------------------------------------------ step shardings

@dataclasses.dataclass(frozen=True)
class StepShardings:
    """Everything the jitted steps need to run over a mesh."""

    mesh: Mesh | AbstractMesh
    rules: tuple
    state: Any  # the TrainState's structure, a NamedSharding per leaf
    batch: NamedSharding  # [B, T] arrays
    replicated: NamedSharding

    @contextlib.contextmanager
    def context(self):
        """Entered INSIDE the traced step: the MoE, KDA and MLA layers read the mesh and rules from it."""
        with jax.sharding.use_abstract_mesh(_abstract(self.mesh)), nn.logical_axis_rules(self.rules):
            yield

    def traced(self, fn):
        def wrapped(*args):
            with self.context():
                return fn(*args)
        return wrapped

    @property
    def params(self) -> Any:
        return self.state.params


def _abstract(mesh):
    return mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh


def batch_spec(rules) -> P:
    return P(_entry(mesh_axes("batch", rules)), _entry(mesh_axes("length", rules)))


def check_batch(shape: Sequence[int], rules, sizes: Mapping[str, int], what: str) -> None:
    """Rows and positions must divide over the "batch" and "length" mesh axes."""
    for dim, logical, name in zip(shape, ("batch", "length"), ("rows", "positions")):
        axes = mesh_axes(logical, rules)
        n = math.prod(sizes[a] for a in axes)
        if dim % n:
            raise ValueError(f"{what}: {dim} {name} must be a multiple of the mesh's {logical!r} axes "
                             f"{' × '.join(f'{a}={sizes[a]}' for a in axes)} = {n}")


def step_shardings(abstract_state: Any, boxed_params: Any, mesh: Mesh | AbstractMesh,
                   rules) -> StepShardings:
    """Shardings of a TrainState (`abstract_state`, from jax.eval_shape) and of batches over `mesh`."""
    sizes = axis_sizes(mesh)
    pspecs = param_specs(boxed_params, rules, sizes)
    specs = jax.tree.map(lambda _: P(), abstract_state)
    specs = specs.replace(params=pspecs,
                          opt_state=specs_like_params(abstract_state.opt_state, abstract_state.params,
                                                      pspecs))
    named = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)
    return StepShardings(mesh, tuple(rules), named, NamedSharding(mesh, batch_spec(rules)),
                         NamedSharding(mesh, P()))


# ------------------------------------------------------------------------------- expert parallelism

@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How the MoE layer's routed part runs inside one shard_map, manual over the axes named here.

    Only mesh axes of size > 1 appear (the others stay automatic and do nothing). Tokens are split over
    `token_axes` (the "batch" and "length" rules), experts over `expert_axes` (the "expert" rule), expert
    widths over `tensor_axes` (the "mlp" rule, when it divides the width). Each shard
    fills capacity buffers [E, C, d] from its own tokens (C from its own token count), the all_to_all sends
    expert e's buffer to the shard holding e, the shard runs its E/P experts on the P·C rows it received,
    tensor shards sum their partial down-projections, and the reverse all_to_all brings results home.
    """

    batch_axes: tuple[str, ...]
    length_axes: tuple[str, ...]
    expert_axes: tuple[str, ...]
    tensor_axes: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]

    def size(self, axes: Sequence[str]) -> int:
        sizes = dict(self.sizes)
        return math.prod(sizes[a] for a in axes)

    @property
    def token_axes(self) -> tuple[str, ...]:
        return self.batch_axes + self.length_axes

    @property
    def router_axes(self) -> tuple[str, ...] | None:
        """Axes the router sums its statistics over (None when tokens are not split)."""
        return self.token_axes or None

    def psum_tokens(self, x: jax.Array) -> jax.Array:
        return x if self.router_axes is None else jax.lax.psum(x, self.router_axes)

    def to_experts(self, x_buf: jax.Array, local_experts: int) -> jax.Array:
        """[E, C, d] buffers of this shard's tokens -> [E_local, P·C, d] rows for this shard's experts."""
        e, c, d = x_buf.shape
        if self.expert_axes:
            x_buf = jax.lax.all_to_all(x_buf, self.expert_axes, 0, 0, tiled=True)  # block i: from shard i
        p = e // local_experts
        return x_buf.reshape(p, local_experts, c, d).swapaxes(0, 1).reshape(local_experts, p * c, d)

    def from_experts(self, y: jax.Array, num_experts: int) -> jax.Array:
        """Inverse of `to_experts` for the experts' outputs, after summing tensor-parallel partials."""
        local, rows, d = y.shape
        if self.tensor_axes:
            y = jax.lax.psum(y, self.tensor_axes)
        p = num_experts // local
        y = y.reshape(local, p, rows // p, d).swapaxes(0, 1).reshape(num_experts, rows // p, d)
        if self.expert_axes:
            y = jax.lax.all_to_all(y, self.expert_axes, 0, 0, tiled=True)
        return y

    def shard(self, fn):
        """fn(x, h, w_router, (w_gate, w_up, w_down), state) -> (y, state, stats, aux_loss), per shard."""
        tokens = P(_entry(self.batch_axes), _entry(self.length_axes), None)
        e, t = _entry(self.expert_axes), _entry(self.tensor_axes)
        weights = (P(e, None, t), P(e, None, t), P(e, t, None))
        manual = frozenset(self.token_axes + self.expert_axes + self.tensor_axes)
        return jax.shard_map(fn, in_specs=(tokens, tokens, P(), weights, P()),
                             out_specs=(tokens, P(), P(), P()), axis_names=manual, check_vma=True)


def expert_parallel(num_experts: int, expert_width: int) -> ExpertParallel | None:
    """The expert-parallel layout from the context mesh and rules; None outside a mesh (local path)."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return None
    sizes = axis_sizes(mesh)
    split = lambda logical: tuple(a for a in mesh_axes(logical, rules) if sizes[a] > 1)
    expert_axes, tensor_axes = split("expert"), split("mlp")
    n_exp = math.prod(sizes[a] for a in expert_axes)
    if num_experts % n_exp:
        raise ValueError(f"MoEConfig.num_experts={num_experts} must be a multiple of the mesh's expert "
                         f"axes {expert_axes} of total size {n_exp}")
    if expert_width % math.prod(sizes[a] for a in tensor_axes):
        tensor_axes = ()  # widths that do not divide stay whole (replicated), like any parameter
    layout = ExpertParallel(split("batch"), split("length"), expert_axes, tensor_axes,
                            tuple(sizes.items()))
    return layout if layout.token_axes + expert_axes + tensor_axes else None
