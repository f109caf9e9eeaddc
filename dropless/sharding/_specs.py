"""Sharded parameters, optimizer state and batches: the PartitionSpecs `AXIS_RULES` gives
them, their placement on a mesh, and the all-gather of fsdp-sharded arrays inside a
`jax.shard_map` (their gradient is reduce-scattered by the transpose), so storage and optimizer
state are split, compute is not (ZeRO-3 style: the train step gathers one layer at a time).
Arrays that are not experts' weights split that dimension over `fsdp` x `expert`, so that the
expert axis does not copy them."""

import math
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from dropless._experts import GroupedExperts
from dropless.sharding._mesh import AXIS_RULES, batch_spec

FSDP_MIN_SIZE = 2**16  # parameters with fewer elements stay replicated under fsdp


def is_array_like(x) -> bool:
    """An array, or the `jax.ShapeDtypeStruct` that stands for one under `jax.eval_shape`
    (which `eqx.is_array` rejects): what the sharding helpers give a spec."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def logical_param_specs(model: PyTree, *, fsdp_min_size: int = FSDP_MIN_SIZE) -> PyTree:
    """A logical PartitionSpec for every array of `model` (None for everything else).

    The experts dimension of `GroupedExperts` weights (the third from last, after any stacked
    layer dimensions; the second from last of their biases) is "experts"; the largest other
    dimension of every floating array with at least `fsdp_min_size` elements is "fsdp";
    everything else is replicated.
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
            # weights [*layers experts in out], biases (gpt-oss) [*layers experts out]
            def expert_spec(path, a):
                if not is_array_like(a):
                    return None
                bias = getattr(path[-1], "name", "").endswith("_bias")
                return spec(a, a.ndim - (2 if bias else 3))

            return jax.tree_util.tree_map_with_path(expert_spec, n)
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
