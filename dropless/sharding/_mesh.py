"""Meshes and the one table from logical axes to mesh axes.

The mesh has up to three named axes, outermost first: `data` (pure data parallelism), `fsdp`
(data parallelism whose devices also split the storage of large parameters and of their optimizer
state) and `expert` (data parallelism whose devices also split the routed experts: expert
parallelism, innermost so that the all-to-all stays on the fastest links). Tokens are split over
all three.
"""

import math
import re
from collections.abc import Mapping
from types import MappingProxyType

import jax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

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


def axes_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """The number of devices along `axes` of `mesh`."""
    return math.prod(mesh.shape[a] for a in axes)


def mesh_axes(mesh: Mesh, logical: str) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that `AXIS_RULES` maps the logical axis `logical` to."""
    return tuple(a for a in AXIS_RULES[logical] if a in mesh.shape and mesh.shape[a] > 1)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes that split tokens (the "batch" row of the table)."""
    return mesh_axes(mesh, "batch")


def batch_spec(mesh: Mesh) -> P:
    """PartitionSpec of any batch array: the leading dimension split over `batch_axes`."""
    axes = batch_axes(mesh)
    return P(axes or None)
