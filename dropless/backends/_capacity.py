"""Slots per expert plus a chunked loop for the overflow: one big batched matmul, dropless.

`CapacityGroupedMatmul` multiplies a static number of slots per expert in one batched matmul
and walks whatever overflows them with `chunked`'s loops; it never drops a row, and gives
accelerators one large matmul when routing is near balance.
"""

import functools
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dropless._experts import AbstractGroupedMatmul
from dropless.backends._chunked import (
    add_row_chunks,
    batched_weight_grad,
    check_count,
    chunked_matmul,
    default_capacity,
    default_chunk,
    group_starts,
    group_tails,
    slot_sources,
    take_slots,
)


class SlotLayout(eqx.Module):
    """Where each expert's first `capacity` rows sit in `[experts capacity]` slots, both ways.

    Each row fills at most one slot and each slot holds at most one row, so moving rows into
    slots and back are gathers whose transposes are the opposite gathers (no scatter-add).
    """

    src: Int[Array, "experts capacity"]  # the row in each slot (clipped where unfilled)
    filled: Bool[Array, "experts capacity"]
    owner: Int[Array, " rows"]  # the expert of each row
    position: Int[Array, " rows"]  # its slot, clipped where past capacity
    in_slots: Bool[Array, " rows"]

    @staticmethod
    def of(group_sizes: Int[Array, " experts"], rows: int, capacity: int) -> "SlotLayout":
        n_experts = group_sizes.shape[0]
        starts = group_starts(group_sizes)
        src, filled = slot_sources(starts, group_sizes, capacity, rows)
        owner = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")
        owner = jnp.clip(owner, 0, n_experts - 1)
        position = jnp.arange(rows) - starts[owner]
        return SlotLayout(
            src=src,
            filled=filled,
            owner=owner,
            position=jnp.clip(position, 0, capacity - 1),
            in_slots=position < capacity,
        )


def _gather_slots(x: Float[Array, "rows width"], layout: SlotLayout):
    """Each expert's first `capacity` rows, zeros in unfilled slots."""
    return take_slots(x, layout.src, layout.filled)


def _gather_rows(y: Float[Array, "experts capacity width"], layout: SlotLayout):
    """Row r from its slot; zeros for rows past their expert's capacity."""
    return jnp.where(layout.in_slots[:, None], y[layout.owner, layout.position], 0)


def _slot_matmul(x, rhs, contract_rhs_dim):
    """x[e] @ rhs[e] (contract_rhs_dim=1) or x[e] @ rhs[e].T (=2), in x's dtype.

    XLA's bf16 matmuls accumulate in float32 on the CPU and the GPU whatever their output
    dtype; asking for a float32 output and rounding it afterwards wrote and read a float32
    copy of the result (H200, 256 experts x 256 bf16 rows, balanced groups: fwd+bwd at 0.54
    of dense throughput with that copy, 0.60 without).
    """
    spec = "eci,eio->eco" if contract_rhs_dim == 1 else "eco,eio->eci"
    return jnp.einsum(spec, x, rhs).astype(x.dtype)


def _capacity_matmul(lhs, rhs, group_sizes, layout, chunk, per_trip, contract_rhs_dim):
    """The slots' batched matmul, then the chunked loop for the rows past the capacity."""
    y = _gather_rows(_slot_matmul(_gather_slots(lhs, layout), rhs, contract_rhs_dim), layout)
    capacity = layout.src.shape[1]
    overflow = chunked_matmul(lhs, rhs, group_sizes, chunk, capacity, contract_rhs_dim, per_trip)
    return jnp.where(layout.in_slots[:, None], y, overflow)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def capacity_grouped_matmul(
    lhs: Float[Array, "rows in_"],
    rhs: Float[Array, "experts in_ out"],
    group_sizes: Int[Array, " experts"],
    capacity: int,
    chunk: int,
    per_trip: int | None = None,
) -> Float[Array, "rows out"]:
    """The grouped matmul of `CapacityGroupedMatmul`, with its exact hand-written gradient.

    Rows move into slots and back by gathers in both directions, and the weight gradient is
    the slots' batched matmul (written once) plus, in place, the overflow rows of the experts
    that have any: no scatter-add, and no buffer-wide zeros or sums of [experts in out].
    """
    return _capacity_fwd(lhs, rhs, group_sizes, capacity, chunk, per_trip)[0]


def _capacity_fwd(lhs, rhs, group_sizes, capacity, chunk, per_trip):
    layout = SlotLayout.of(group_sizes, lhs.shape[0], capacity)
    out = _capacity_matmul(lhs, rhs, group_sizes, layout, chunk, per_trip, contract_rhs_dim=1)
    return out, (lhs, rhs, group_sizes, layout)


def _capacity_bwd(capacity, chunk, per_trip, res, g):
    lhs, rhs, group_sizes, layout = res
    g = jax.lax.optimization_barrier(g.astype(lhs.dtype))  # see _cgmm_bwd
    dlhs = _capacity_matmul(g, rhs, group_sizes, layout, chunk, per_trip, contract_rhs_dim=2)
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    drhs = batched_weight_grad(_gather_slots(lhs, layout), _gather_slots(g, layout), dtype)
    starts, sizes = group_tails(group_sizes, capacity)
    drhs = add_row_chunks(drhs, lhs, g, starts, sizes, chunk, per_trip)
    return dlhs, drhs.astype(rhs.dtype), None


capacity_grouped_matmul.defvjp(_capacity_fwd, _capacity_bwd)


class CapacityGroupedMatmul(AbstractGroupedMatmul):
    """One batched matmul over `capacity` slots per expert, plus the chunked loop for the rows
    of any group longer than that: dropless (overflow rows are computed, never dropped) and
    one large, accelerator-friendly matmul when routing is near balance.

    Costs `capacity_factor` times the routed FLOPs in the batched part; the overflow loop runs
    only when a group exceeds its capacity.
    """

    requires_gpu: ClassVar[bool] = False

    capacity_factor: float = eqx.field(default=1.25, static=True)
    # None: a power of two near the mean group size (`default_chunk(..., per_group=1)`). Rows
    # overflow the slots when routing is skewed, by about a mean group per overflowing expert,
    # and every chunk is a host round trip on a GPU, so larger chunks pay off (H200, 256 skewed
    # groups of mean 256: fwd+bwd 0.060 of dense with 64-row chunks, 0.098 with 256, 0.103
    # with 512). The mean keeps the padding per expert below one group.
    chunk: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor ({self.capacity_factor}) must be > 0")
        check_count("chunk", self.chunk, None)

    def _impl(self, lhs, rhs, group_sizes):
        rows, n_experts = lhs.shape[0], rhs.shape[0]
        capacity = min(default_capacity(rows, n_experts, self.capacity_factor), rows)
        chunk = self.chunk or default_chunk(rows, n_experts, per_group=1)
        gs = group_sizes.astype(jnp.int32)
        return capacity_grouped_matmul(lhs, rhs, gs, capacity, chunk, _overflow_walk())


def _overflow_walk() -> int | None:
    """How the overflow loop walks its chunks on the default platform (see `_for_each_chunk`):
    on the CPU, nested loops (the flat loop is no faster there); on an accelerator, one flat
    loop of 4 chunks per trip, since each trip of a data-dependent loop is a host round trip
    (H200, 256 skewed groups of mean 256: fwd+bwd from 0.109 of dense to 0.149; 16 per trip
    gained little more, and spare places in the last trip are computed and masked). The two
    walks sum the weight gradient in a different order, so results differ by float rounding."""
    return None if jax.default_backend() == "cpu" else 4
