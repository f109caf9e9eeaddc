"""The default grouped matmul: each expert group walked in fixed-size row chunks.

One ordinary matmul per chunk. FLOPs are those of the routed rows plus at most `chunk - 1` rows
per expert, memory is O(rows * width + experts * in * out), and the gradient is exact. When
groups are short, the weight gradient takes each group's first (mean-size) rows in one batched
matmul instead. The chunk loops here also serve `CapacityGroupedMatmul`'s overflow rows.
"""

import functools
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dropless._experts import AbstractGroupedMatmul


def check_count(name: str, value, *allowed) -> None:
    """Raises ValueError naming `name` unless `value` is one of `allowed` or an int >= 1."""
    if value in allowed:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} ({value!r}) must be {choices} or an int >= 1")


def default_chunk(rows: int, n_experts: int, per_group: int = 4) -> int:
    """A power of two near 1/`per_group` of the mean group size, in [16, 512]: big enough for
    an efficient matmul, small enough that the padding per expert (< chunk rows) stays cheap."""
    mean = max(rows // max(n_experts, 1), 1)
    return int(min(512, max(16, 2 ** math.floor(math.log2(max(mean // per_group, 1))))))


def group_starts(group_sizes: Int[Array, " experts"]) -> Int[Array, " experts"]:
    return jnp.cumsum(group_sizes) - group_sizes


def group_tails(group_sizes, skip):
    """Each group's rows from its `skip`-th on: (first row, row count) per expert."""
    return group_starts(group_sizes) + skip, jnp.maximum(group_sizes - skip, 0)


def _chunk_window(start, size, c, chunk: int, rows: int):
    """The window of the `c`-th chunk of a segment of `size` rows from row `start`: the window's
    first row, kept in bounds as dynamic_slice would, and which of its `chunk` rows belong to
    that chunk. Clamping the window instead of padding the operands saves copying them."""
    start, remaining = start + c * chunk, size - c * chunk
    first = jnp.clip(start, 0, rows - chunk)
    position = jnp.arange(chunk) + first - start
    return first, (position >= 0) & (position < remaining)


def _for_each_chunk(starts, sizes, chunk, rows, body, carry, per_trip=None):
    """Calls body(expert, chunk_index, first_row, valid_mask, carry) for each chunk of each
    segment, in order.

    Trip counts are data-dependent (while loops); on a GPU each trip of such a loop waits for
    the host to read its condition. per_trip=None: a loop over experts around a loop over each
    one's chunks, one trip per expert and per chunk, and only chunks holding rows run (the
    cheapest on a CPU). per_trip=n: one loop over all chunks, n of them per trip in an inner
    loop of static length, so about chunks / n data-dependent trips, at the price of up to
    n - 1 spare places in the last trip. Those repeat the last chunk with an all-False mask
    and cost a full chunk each; a body must leave the carry unchanged for such a call,
    whatever its chunk index. (Unrolling the inner loop made XLA on the CPU copy the carried
    weight gradient at every chunk: fwd+bwd about 9x slower at 256 experts, one scratch run
    on the 2-core CI-sized box.)
    """
    if per_trip is None:

        def per_expert(e, carry):
            def per_chunk(c, carry):
                first, valid = _chunk_window(starts[e], sizes[e], c, chunk, rows)
                return body(e, c, first, valid, carry)

            return jax.lax.fori_loop(0, (sizes[e] + chunk - 1) // chunk, per_chunk, carry)

        return jax.lax.fori_loop(0, sizes.shape[0], per_expert, carry)

    counts = (sizes + chunk - 1) // chunk
    ends = jnp.cumsum(counts)
    n_chunks = ends[-1]

    def at_chunk(t, carry):
        clamped = jnp.minimum(t, n_chunks - 1)  # spare places repeat the last chunk
        e = jnp.searchsorted(ends, clamped, side="right", method="compare_all")
        c = clamped - (ends[e] - counts[e])
        first, valid = _chunk_window(starts[e], sizes[e], c, chunk, rows)
        return body(e, c, first, valid & (t < n_chunks), carry)

    def one_trip(trip, carry):
        return jax.lax.fori_loop(
            0, per_trip, lambda i, carry: at_chunk(trip * per_trip + i, carry), carry
        )

    return jax.lax.fori_loop(0, (n_chunks + per_trip - 1) // per_trip, one_trip, carry)


def chunked_matmul(lhs, rhs, group_sizes, chunk, skip, contract_rhs_dim, per_trip=None):
    """out[r] = lhs[r] @ rhs[e] (contract_rhs_dim=1) or lhs[r] @ rhs[e].T (=2) for the rows of
    each group from its `skip`-th on; every other row of `out` is zero. `per_trip`: see
    `_for_each_chunk`."""
    rows, width = lhs.shape
    chunk = min(chunk, rows)
    out_width = rhs.shape[3 - contract_rhs_dim]
    dims = (((1,), (contract_rhs_dim - 1,)), ((), ()))
    starts, sizes = group_tails(group_sizes, skip)

    def body(e, c, first, valid, out):
        x = jax.lax.dynamic_slice(lhs, (first, 0), (chunk, width))
        y = jax.lax.dot_general(x, rhs[e], dims, preferred_element_type=jnp.float32)
        old = jax.lax.dynamic_slice(out, (first, 0), (chunk, out_width))
        new = jnp.where(valid[:, None], y.astype(out.dtype), old)
        return jax.lax.dynamic_update_slice(out, new, (first, 0))

    # zeros_like (not zeros) keeps lhs's varying-manual-axes type inside a user's shard_map
    out = jnp.zeros_like(lhs, shape=(rows, out_width))
    return jax.lax.cond(
        jnp.any(sizes > 0),
        lambda o: _for_each_chunk(starts, sizes, chunk, rows, body, o, per_trip),
        lambda o: o,
        out,
    )


def slot_sources(starts, sizes, slots: int, rows: int):
    """For `slots` slots per segment: the row each slot reads (clipped into the buffer) and
    whether it holds one of the segment's rows."""
    slot = jnp.arange(slots)
    src = jnp.clip(starts[:, None] + slot[None, :], 0, rows - 1)
    return src, slot[None, :] < sizes[:, None]


def take_slots(x, src, filled):
    """x's rows into [segments slots width], zeros in unfilled slots."""
    return jnp.where(filled[..., None], x[src], 0)


def batched_weight_grad(
    x: Float[Array, "experts slots in_"], g: Float[Array, "experts slots out"], dtype
) -> Float[Array, "experts in_ out"]:
    """sum over slots of outer(x, g) per expert: one batched matmul whose [experts in out] output
    (the largest buffer of the backward) is written once, in `dtype` (the weights'). In bf16
    that halves the buffer against float32; the matmul still accumulates in float32, and an
    expert whose rows go past the slots is rounded once more after they are added."""
    return jnp.einsum("esi,eso->eio", x, g, preferred_element_type=dtype)


def add_row_chunks(drhs, lhs, grad_out, starts, sizes, chunk, per_trip=None):
    """drhs[e] += sum of outer(lhs[r], grad_out[r]) over rows starts[e] .. + sizes[e] - 1, chunk by
    chunk, accumulated in float32 per expert: no atomics, deterministic. Only experts with such
    rows are read and rewritten (in place), so nothing is zeroed or added buffer-wide.
    `per_trip`: see `_for_each_chunk`."""
    rows, width = lhs.shape
    out_width = grad_out.shape[1]
    chunk = min(chunk, rows)

    def outer(first, valid):
        # both sides masked: an inf in another expert's row of the window must not give NaN
        x = jnp.where(valid[:, None], jax.lax.dynamic_slice(lhs, (first, 0), (chunk, width)), 0)
        g = jax.lax.dynamic_slice(grad_out, (first, 0), (chunk, out_width))
        g = jnp.where(valid[:, None], g, 0)
        return jax.lax.dot_general(
            x, g, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    if per_trip is not None:
        # one loop over all chunks: the running float32 sum restarts from drhs[e] at an
        # expert's first chunk and is written back after every chunk (the last write stays),
        # so each chunk reads and writes a whole [in out] block where the nested loops write
        # once per expert. A spare place (all-False mask) adds zero to the sum, and at chunk
        # index 0 restarts it from drhs[e], which already holds the rounded total: no change.
        def body(e, c, first, valid, carry):
            drhs, acc = carry
            acc = jnp.where(c == 0, drhs[e].astype(jnp.float32), acc) + outer(first, valid)
            return jax.lax.dynamic_update_index_in_dim(drhs, acc.astype(drhs.dtype), e, 0), acc

        acc = jnp.zeros_like(lhs, shape=(width, out_width), dtype=jnp.float32)
        return _for_each_chunk(starts, sizes, chunk, rows, body, (drhs, acc), per_trip)[0]

    def add_rows(e, drhs):
        def per_chunk(c, acc):
            return acc + outer(*_chunk_window(starts[e], sizes[e], c, chunk, rows))

        acc = jnp.zeros_like(lhs, shape=(width, out_width), dtype=jnp.float32)
        acc = jax.lax.fori_loop(0, (sizes[e] + chunk - 1) // chunk, per_chunk, acc)
        new = (drhs[e].astype(jnp.float32) + acc).astype(drhs.dtype)
        return jax.lax.dynamic_update_index_in_dim(drhs, new, e, 0)

    def per_expert(e, drhs):
        return jax.lax.cond(sizes[e] > 0, add_rows, lambda e, d: d, e, drhs)

    return jax.lax.cond(
        jnp.any(sizes > 0),
        lambda d: jax.lax.fori_loop(0, drhs.shape[0], per_expert, d),
        lambda d: d,
        drhs,
    )


def _chunked_weight_grad(lhs, grad_out, group_sizes, chunk, n_experts, dtype, slot_share=1.0):
    """d rhs[e] = sum over the rows r of group e of outer(lhs[r], grad_out[r]), in `dtype`.

    When groups are short (a mean of at most two chunks), writing the [experts in out] result
    costs more than the matmuls, and a loop over experts writes it twice (zeros, then each
    expert). So the first `slots` rows of every group (`slot_share` of the mean group size,
    rounded up to 8) go through one batched matmul whose output is that buffer, written once;
    only the rows past the slots are then added chunk by chunk, for the experts that have them.
    """
    rows, width = lhs.shape
    chunk = min(chunk, rows)
    starts, sizes = group_starts(group_sizes), group_sizes
    if rows // n_experts <= 2 * chunk:
        slots = min(default_capacity(rows, n_experts, slot_share), rows)
        src, filled = slot_sources(starts, sizes, slots, rows)
        drhs = batched_weight_grad(take_slots(lhs, src, filled), grad_out[src], dtype)
        starts, sizes = starts + slots, jnp.maximum(sizes - slots, 0)
    else:
        drhs = jnp.zeros_like(lhs, shape=(n_experts, width, grad_out.shape[1]), dtype=dtype)
    return add_row_chunks(drhs, lhs, grad_out, starts, sizes, chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_grouped_matmul(
    lhs: Float[Array, "rows in_"],
    rhs: Float[Array, "experts in_ out"],
    group_sizes: Int[Array, " experts"],
    chunk: int,
) -> Float[Array, "rows out"]:
    """The grouped matmul of `ChunkedGroupedMatmul`, with its exact hand-written gradient."""
    return chunked_matmul(lhs, rhs, group_sizes, chunk, 0, contract_rhs_dim=1)


def _cgmm_fwd(lhs, rhs, group_sizes, chunk):
    return chunked_grouped_matmul(lhs, rhs, group_sizes, chunk), (lhs, rhs, group_sizes)


def _cgmm_bwd(chunk, res, g):
    lhs, rhs, group_sizes = res
    # A constant cotangent (the gradient of a sum) would be sunk by XLA into the loops below
    # and re-materialised at every iteration; the barrier makes it an ordinary array.
    g = jax.lax.optimization_barrier(g.astype(lhs.dtype))
    dlhs = chunked_matmul(g, rhs, group_sizes, chunk, 0, contract_rhs_dim=2)
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    weight_grad = functools.partial(
        _chunked_weight_grad, chunk=chunk, n_experts=rhs.shape[0], dtype=dtype
    )
    # How much of the mean group goes in the weight gradient's slots. On the CPU the slot
    # gathers sit in XLA's one temporary buffer, and glibc maps a freed block above 32 MiB
    # afresh, page by page, at every call instead of reusing it: at 256 experts of 32 rows
    # (256 in, 512 out, float32) half the mean keeps that buffer at 29.4 MB (41.9 with the
    # whole mean): skewed groups' fwd+bwd went from a median 4.11 to 3.88 times dense, balanced
    # ones from 3.49 to 3.58 (a net gain where routing is uneven). Elsewhere
    # every overflow chunk is a loop trip, so the whole mean.
    drhs = jax.lax.platform_dependent(
        lhs,
        g,
        group_sizes,
        cpu=functools.partial(weight_grad, slot_share=0.5),
        default=functools.partial(weight_grad, slot_share=1.0),
    )
    return dlhs, drhs.astype(rhs.dtype), None


chunked_grouped_matmul.defvjp(_cgmm_fwd, _cgmm_bwd)


class ChunkedGroupedMatmul(AbstractGroupedMatmul):
    """The default grouped matmul: fixed-size chunks of each group, one matmul each.

    `chunk=None` picks a size from the static shapes (`default_chunk`).
    """

    requires_gpu: ClassVar[bool] = False

    chunk: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        check_count("chunk", self.chunk, None)

    def _impl(self, lhs, rhs, group_sizes):
        chunk = self.chunk or default_chunk(lhs.shape[0], rhs.shape[0])
        return chunked_grouped_matmul(lhs, rhs, group_sizes.astype(jnp.int32), chunk)


def default_capacity(rows: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert: `capacity_factor` times the mean group size, rounded up to 8."""
    mean = rows / max(n_experts, 1)
    return max(8, -(-int(math.ceil(capacity_factor * mean)) // 8) * 8)
