"""Meshes, the ONE table from logical axes to mesh axes, sharded parameters, optimizer state
and batches, and `ShardedMoE`: one MoE layer run expert-parallel by `jax.shard_map`.

The mesh has up to three named axes, outermost first: `data` (pure data parallelism), `fsdp`
(data parallelism whose devices also split the storage of large parameters and of their optimizer
state) and `expert` (data parallelism whose devices also split the routed experts: expert
parallelism, innermost so that the all-to-all stays on the fastest links). Tokens are split over
all three. Nothing in here is global: the caller builds the mesh and hands it to these functions.

Inside a `jax.shard_map` each device sees its slice of the batch, the full router and dense
weights, and the local slice `[experts / ep ...]` of every `GroupedExperts` weight; the MoE layers
must use an expert-parallel dispatcher (`dropless.with_backend(model, "ep")`). Parameters sharded
over `fsdp` are all-gathered there (`gather_fsdp`; their gradient is reduce-scattered by the
transpose), so storage and optimizer state are split, compute is not (ZeRO-3 style). Arrays
that are not experts' weights split that dimension over `fsdp` x `expert`, so that the expert
axis does not copy them. The train step on a mesh is `dropless.train.sharded`.
"""

import math
import re
from collections.abc import Mapping
from types import MappingProxyType

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PyTree

from dropless import balance
from dropless.dispatch import AbstractDispatcher
from dropless.experts import GroupedExperts
from dropless.moe import MoE, MoEStats

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")

# The one table: logical axis -> mesh axes. Parameters and batches are described in logical
# axes; this table alone decides where they go. A mesh axis that is absent or of size 1 is
# ignored, and a dimension that its mesh axes do not divide stays whole (replicated), except
# "experts", which must divide.
AXIS_RULES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "batch": ("data", "fsdp", "expert"),  # tokens / sequences: every device its own slice
        "experts": ("expert",),  # routed experts of GroupedExperts weights (expert parallelism)
        # the largest dimension of a large parameter (storage only); an array whose experts
        # take the expert axis splits this dimension over fsdp alone
        "fsdp": ("fsdp", "expert"),
    }
)

FSDP_MIN_SIZE = 2**16  # parameters with fewer elements stay replicated under fsdp


# --- meshes ---------------------------------------------------------------------------------


def parse_mesh(spec: str) -> dict[str, int]:
    """'data=2,expert=4' -> {'data': 2, 'expert': 4} (the `--mesh` command-line format)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
        if match is None:
            raise ValueError(
                f"mesh spec {spec!r}: expected 'axis=size[,axis=size...]', got {part!r}"
            )
        name, size = match.group(1), int(match.group(2))
        if name not in MESH_AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r}; axes are {MESH_AXES}")
        if name in sizes:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if size < 1:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} must have size >= 1, got {size}")
        sizes[name] = size
    return sizes


def make_mesh(
    data: int = 1, fsdp: int = 1, expert: int = 1, *, devices: "list[jax.Device] | None" = None
) -> Mesh:
    """A (data, fsdp, expert) mesh over `devices` (default: every device of every process).

    The axes are `AxisType.Auto`, so `jax.shard_map` and `jax.jit` accept unplaced inputs; the
    product of the sizes must equal the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = (data, fsdp, expert)
    if any(s < 1 for s in shape):
        raise ValueError(
            f"mesh axis sizes must be >= 1, got data={data} fsdp={fsdp} expert={expert}"
        )
    if math.prod(shape) != len(devices):
        cpu = devices and devices[0].platform == "cpu"
        hint = (
            f"; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={math.prod(shape)} "
            "(set before JAX starts) emulates that many devices"
            if cpu
            else ""
        )
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x expert={expert} = {math.prod(shape)} devices, but "
            f"{len(devices)} device{'s are' if len(devices) != 1 else ' is'} given; the product "
            f"must equal the device count{hint}"
        )
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def mesh_from_spec(spec: str, *, devices: "list[jax.Device] | None" = None) -> Mesh:
    """`make_mesh` from a `--mesh` string; unnamed axes get size 1, and an empty string puts
    every device on `data`."""
    sizes = parse_mesh(spec)
    if not sizes:
        sizes = {"data": len(jax.devices() if devices is None else devices)}
    return make_mesh(**sizes, devices=devices)


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _mesh_axes(mesh: Mesh, logical: str) -> tuple[str, ...]:
    return tuple(a for a in AXIS_RULES[logical] if a in mesh.shape and mesh.shape[a] > 1)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes that split tokens (the "batch" row of the table)."""
    return _mesh_axes(mesh, "batch")


def batch_spec(mesh: Mesh) -> P:
    """PartitionSpec of any batch array: the leading dimension split over `batch_axes`."""
    axes = batch_axes(mesh)
    return P(axes or None)


# --- parameters: logical specs, mesh specs -------------------------------------------------------


def is_array_like(x) -> bool:
    """An array, or the `jax.ShapeDtypeStruct` that stands for one under `jax.eval_shape`
    (which `eqx.is_array` rejects): what the sharding helpers give a spec."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def logical_param_specs(model: PyTree, *, fsdp_min_size: int = FSDP_MIN_SIZE) -> PyTree:
    """A logical PartitionSpec for every array of `model` (None for everything else).

    The experts dimension of `GroupedExperts` weights (the third from last, after any stacked
    layer dimensions) is "experts"; the largest other dimension of every floating array with at
    least `fsdp_min_size` elements is "fsdp"; everything else is replicated.
    """

    def spec(leaf, experts_dim=None):
        if not is_array_like(leaf):
            return None
        names: list[str | None] = [None] * leaf.ndim
        if experts_dim is not None:
            names[experts_dim] = "experts"
        if jnp.issubdtype(leaf.dtype, jnp.inexact) and leaf.size >= fsdp_min_size:
            free = [d for d in range(leaf.ndim) if names[d] is None]
            if free:
                names[max(free, key=lambda d: (leaf.shape[d], -d))] = "fsdp"
        return P(*names)

    def node(n):
        if isinstance(n, GroupedExperts):
            return jax.tree.map(lambda a: spec(a, a.ndim - 3 if is_array_like(a) else None), n)
        return spec(n)

    return jax.tree.map(node, model, is_leaf=lambda n: isinstance(n, GroupedExperts))


def to_mesh_spec(logical: P, shape: tuple[int, ...], mesh: "Mesh | Mapping[str, int]") -> P:
    """A logical PartitionSpec -> mesh PartitionSpec, through `AXIS_RULES`. A mesh axis splits
    one dimension at most ("experts" first); a dimension takes the longest leading run of its
    remaining mesh axes whose size divides it. `mesh`: a Mesh, or its axis sizes alone."""
    sizes = dict(mesh.shape if isinstance(mesh, Mesh) else mesh)

    def product(axes):
        return math.prod(sizes[a] for a in axes)

    experts = [d for d, name in enumerate(logical) if name == "experts"]
    out: list = [None] * len(shape)
    used: set[str] = set()
    for d in experts + [d for d in range(len(shape)) if d not in experts]:
        name, size = logical[d], shape[d]
        rule = AXIS_RULES[name] if name else ()
        axes = tuple(a for a in rule if sizes.get(a, 1) > 1 and a not in used)
        if name == "experts" and axes and size % product(axes):
            raise ValueError(
                f"the experts dimension ({size}) must be divisible by the size of mesh axes "
                f"{axes} ({product(axes)}): n_routed_experts % expert == 0"
            )
        while axes and size % product(axes):
            axes = axes[:-1]
        used.update(axes)
        out[d] = None if not axes else axes[0] if len(axes) == 1 else axes
    return P(*out)


def param_specs(model: PyTree, mesh: Mesh, *, fsdp_min_size: int = FSDP_MIN_SIZE) -> PyTree:
    """Mesh PartitionSpecs for every array of `model` (None elsewhere), per `AXIS_RULES`."""
    logical = logical_param_specs(model, fsdp_min_size=fsdp_min_size)
    return jax.tree.map(
        lambda leaf, spec: None if spec is None else to_mesh_spec(spec, leaf.shape, mesh),
        model,
        logical,
        is_leaf=lambda n: n is None,
    )


def _shardings(specs: PyTree, mesh: Mesh) -> PyTree:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def shard_model(model: PyTree, mesh: Mesh, *, fsdp_min_size: int = FSDP_MIN_SIZE) -> PyTree:
    """The same model with every array placed on `mesh` as `param_specs` says."""
    arrays, static = eqx.partition(model, is_array_like)
    specs = param_specs(arrays, mesh, fsdp_min_size=fsdp_min_size)
    return eqx.combine(jax.device_put(arrays, _shardings(specs, mesh)), static)


def opt_state_specs(opt_state: PyTree, params: PyTree, specs: PyTree) -> PyTree:
    """PartitionSpecs for an optax state: every leaf that mirrors a parameter (same key path
    suffix, same shape: Adam's mu and nu, momentum, ...) is sharded like it; the rest (step
    counts, scalars, factored statistics) is replicated."""
    by_path: dict[tuple, tuple[tuple[int, ...], P]] = {}
    for (path, leaf), spec in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree.leaves(specs),
        strict=True,
    ):
        by_path[tuple(path)] = (leaf.shape, spec)

    def spec_of(path, leaf):
        if not hasattr(leaf, "shape"):  # arrays and the ShapeDtypeStructs of jax.eval_shape
            return None
        for start in range(len(path)):
            hit = by_path.get(tuple(path[start:]))
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return P()

    return jax.tree_util.tree_map_with_path(spec_of, opt_state)


def shard_batch(batch: PyTree, mesh: Mesh) -> PyTree:
    """Places a host batch on `mesh`, its leading dimension split over `batch_axes`.

    With several processes, each passes its own rows (`jax.make_array_from_process_local_data`).
    """
    sharding = NamedSharding(mesh, batch_spec(mesh))
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), batch
    )


# --- checks --------------------------------------------------------------------------------


def dispatchers(model: PyTree) -> list[AbstractDispatcher]:
    """Every dispatcher strategy inside `model` (one per MoE stack)."""
    nodes = jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, AbstractDispatcher))
    return [node for node in nodes if isinstance(node, AbstractDispatcher)]


def check_expert_parallel(model: PyTree, mesh: Mesh) -> None:
    """Raises if `model` cannot run sharded on `mesh`: a dispatcher that cannot move tokens
    between devices while the expert axis is > 1, a dispatcher whose axis the mesh lacks or
    that is not the expert axis, or a number of experts that the expert axis does not divide."""
    ep = mesh.shape.get("expert", 1)
    for node in dispatchers(model):
        if ep > 1 and not type(node).supports_expert_parallel:
            raise ValueError(
                f"{type(node).__name__} cannot dispatch across devices, and the mesh's expert axis "
                f"has size {ep}; use dropless.with_backend(model, 'ep') (or expert=1)"
            )
        axis = getattr(node, "axis_name", None)
        if type(node).supports_expert_parallel and axis is not None and axis not in mesh.shape:
            raise ValueError(
                f"{type(node).__name__}.axis_name is {axis!r}, which is not an axis of the mesh "
                f"{dict(mesh.shape)}"
            )
        expert_axes = AXIS_RULES["experts"]
        if axis is not None and axis not in expert_axes and mesh.shape.get(axis, 1) > 1:
            raise ValueError(
                f"{type(node).__name__}.axis_name is {axis!r}, but the experts are split over "
                f"{expert_axes[0]!r} (size {ep}); dispatch over that axis"
            )
    arrays = eqx.filter(model, eqx.is_array)
    param_specs(arrays, mesh, fsdp_min_size=2**62)  # raises on indivisible experts


# --- inside the shard_map -------------------------------------------------------------------


def fsdp_specs(model: PyTree, mesh: Mesh, *, fsdp_min_size: int = FSDP_MIN_SIZE) -> PyTree:
    """For every array of `model`, its mesh spec restricted to the dimension that the "fsdp"
    row of the table splits (None elsewhere, and for arrays without one): what `gather_fsdp`
    gathers. The experts dimension stays split."""
    logical = logical_param_specs(model, fsdp_min_size=fsdp_min_size)

    def restrict(leaf, spec):
        if spec is None:
            return None
        mesh_spec = to_mesh_spec(spec, leaf.shape, mesh)
        return P(*(m if name == "fsdp" else None for name, m in zip(spec, mesh_spec, strict=True)))

    return jax.tree.map(restrict, model, logical, is_leaf=lambda n: n is None)


def gather_fsdp(arrays: PyTree, specs: PyTree) -> PyTree:
    """Inside shard_map: all-gathers every array over the mesh axes of its `fsdp_specs` entry
    (its gradient reduce-scatters)."""

    def gather(leaf, spec):
        for dim, axes in enumerate(spec or ()):
            if axes is not None:
                leaf = jax.lax.all_gather(leaf, axes, axis=dim, tiled=True)
        return leaf

    return jax.tree.map(gather, arrays, specs, is_leaf=lambda n: n is None)


def reduce_moe_stats(stats: MoEStats, axes: tuple[str, ...]) -> MoEStats:
    """Inside shard_map: MoE statistics of the whole batch from those of each shard.

    Counts and drops are summed, MaxVio is recomputed from the summed counts, the losses are
    averaged over shards: exact for the z-loss and (sequences never straddle shards) the
    sequence-wise loss; the batch-wise balance loss becomes the mean of per-shard losses.
    """
    if not axes:
        return stats
    counts = jax.lax.psum(stats.tokens_per_expert, axes)
    return MoEStats(
        tokens_per_expert=counts,
        max_vio=balance.max_violation(counts),
        balance_loss=jax.lax.pmean(stats.balance_loss, axes),
        seq_balance_loss=jax.lax.pmean(stats.seq_balance_loss, axes),
        z_loss=jax.lax.pmean(stats.z_loss, axes),
        dropped=jax.lax.psum(stats.dropped, axes),
    )


# --- an MoE layer on a mesh --------------------------------------------------------------------


class ShardedMoE(eqx.Module):
    """An MoE layer run by `jax.shard_map` over `mesh`: call it on global tokens `[tokens dim]`
    (split over `batch_axes`), get global outputs and `MoEStats` of the whole batch as
    `reduce_moe_stats` forms them: counts and MaxVio of all tokens, the losses averaged over
    shards. With `seq_len=None` each shard's tokens count as one sequence, so the sequence-wise
    (and the batch-wise) balance loss differ from one `MoE` call on all the tokens; pass the
    sequence length to make the sequence-wise loss exact.

    `moe` holds global arrays; inside, each device sees its slice of the experts. Differentiable
    with respect to `moe` and the tokens. The tokens must divide evenly over the batch axes.
    """

    moe: MoE
    mesh: Mesh = eqx.field(static=True)
    seq_len: int | None = eqx.field(default=None, static=True)
    fsdp_min_size: int = eqx.field(default=FSDP_MIN_SIZE, static=True)

    def __call__(
        self, x: Float[Array, "tokens dim"]
    ) -> tuple[Float[Array, "tokens dim"], MoEStats]:
        axes = batch_axes(self.mesh)
        shards = _size(self.mesh, axes)
        if x.shape[0] % shards:
            raise ValueError(
                f"tokens ({x.shape[0]}) must be divisible by the batch shards ({shards}: mesh axes "
                f"{axes})"
            )
        arrays, static = eqx.partition(self.moe, eqx.is_array)
        specs = param_specs(arrays, self.mesh, fsdp_min_size=self.fsdp_min_size)
        gathers = fsdp_specs(arrays, self.mesh, fsdp_min_size=self.fsdp_min_size)

        def local(arrays, x):
            moe = eqx.combine(gather_fsdp(arrays, gathers), static)
            y, stats = moe(x, seq_len=self.seq_len)
            return y, reduce_moe_stats(stats, axes)

        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(specs, batch_spec(self.mesh)),
            out_specs=(batch_spec(self.mesh), P()),
            check_vma=False,
        )(arrays, x)


def shard_moe(
    moe: MoE, mesh: Mesh, *, seq_len: int | None = None, fsdp_min_size: int = FSDP_MIN_SIZE
) -> ShardedMoE:
    """Wraps `moe` to run expert-parallel on `mesh` (checks it can: see `check_expert_parallel`).

    `seq_len` groups each shard's tokens into sequences for the sequence-wise balance loss.
    """
    check_expert_parallel(moe, mesh)
    return ShardedMoE(moe, mesh, seq_len, fsdp_min_size)
