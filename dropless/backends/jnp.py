"""Pure-jnp backend: runs anywhere, and is the default.

- `SortDispatcher`: a stable sort of the `tokens * k` copies by expert id. Dispatch and combine
  are gathers through a permutation and its inverse, forward *and* backward (a custom VJP), so
  there are no scatter-add atomics and results are bit-for-bit deterministic.
- `ChunkedGroupedMatmul`: walks the expert groups in fixed-size row chunks, one ordinary matmul
  per chunk. FLOPs are those of the routed rows plus at most `chunk - 1` rows per expert, memory
  is O(rows * width + experts * in * out), and the gradient is exact. When groups are short, the
  weight gradient takes each group's first (mean-size) rows in one batched matmul instead.
- `CapacityGroupedMatmul`: one batched matmul over a static number of slots per expert, and the
  chunked loop for whatever overflows them; never drops a row, and gives accelerators one big
  matmul when routing is near balance.
- `RaggedDot`: `jax.lax.ragged_dot`, exact but dense-materialised by XLA today (a reference).
"""

import functools
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dropless.balance import expert_counts
from dropless.dispatch import AbstractDispatcher, Dispatched
from dropless.experts import AbstractGroupedMatmul


@jax.custom_vjp
def permute_rows(
    x: Float[Array, "n dim"], perm: Int[Array, " n"], inverse: Int[Array, " n"]
) -> Float[Array, "n dim"]:
    """x[perm]; the gradient is the gather through `inverse` (no scatter)."""
    return x[perm]


def _permute_fwd(x, perm, inverse):
    return x[perm], inverse


def _permute_bwd(inverse, g):
    return g[inverse], None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def _gather_sum(
    rows: Float[Array, "n dim"],
    index: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"] | None = None,
) -> Float[Array, "tokens dim"]:
    """sum_j weights[t, j] * rows[index[t, j]] in float32 (weights default to 1).

    Written as k gathers of [tokens dim] feeding one sum, which XLA fuses into a single loop:
    the [tokens k dim] gathered copies are never materialised (on the CPU, writing such a
    buffer costs ~10x more than reading it).
    """
    total = None
    for j in range(index.shape[1]):
        term = rows[index[:, j]].astype(jnp.float32)
        if weights is not None:
            term = term * weights[:, j, None].astype(jnp.float32)
        total = term if total is None else total + term
    return total


def _gathered_dots(
    rows: Float[Array, "n dim"], index: Int[Array, "tokens k"], dy: Float[Array, "tokens dim"]
) -> Float[Array, "tokens k"]:
    """out[t, j] = <rows[index[t, j]], dy[t]> in float32.

    A reduction does not fuse with a gather on the CPU, so the dot products are summed in two
    stages: first as explicit adds of column blocks, which XLA fuses with the gathers into one
    loop writing only [tokens k dim/blocks] partial sums, then one small reduction.
    """
    dim = rows.shape[1]
    blocks = next(b for b in (16, 8, 4, 2, 1) if dim % b == 0)
    width = dim // blocks
    dy = dy.astype(jnp.float32)
    partial = []
    for j in range(index.shape[1]):
        part = None
        for b in range(blocks):
            cols = slice(b * width, (b + 1) * width)
            term = rows[index[:, j], cols].astype(jnp.float32) * dy[:, cols]
            part = term if part is None else part + term
        partial.append(part)
    return jnp.stack(partial, axis=1).sum(-1)


@jax.custom_vjp
def expand_rows(
    x: Float[Array, "tokens dim"], order: Int[Array, " copies"], inverse: Int[Array, " copies"]
) -> Float[Array, "copies dim"]:
    """Row r = x[order[r] // k]: each token copied to the rows of its k copies, in one gather.
    The gradient gathers back through `inverse` and sums each token's k copies (no scatter)."""
    k = order.shape[0] // x.shape[0]
    return x[order // k]


def _expand_fwd(x, order, inverse):
    return expand_rows(x, order, inverse), (x.shape[0], inverse)


def _expand_bwd(res, g):
    tokens, inverse = res
    return _gather_sum(g, inverse.reshape(tokens, -1)).astype(g.dtype), None, None


expand_rows.defvjp(_expand_fwd, _expand_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def sum_copies(
    y_rows: Float[Array, "copies dim"],
    order: Int[Array, " copies"],
    inverse: Int[Array, " copies"],
    k: int,
) -> Float[Array, "tokens dim"]:
    """y[t] = sum_j y_rows[inverse[t*k + j]], summed in float32 and returned in y_rows' dtype:
    `combine_rows` without weights (`expand_rows` transposed). Its backward is the gather
    `dy[order // k]`, and it keeps no rows for it."""
    return _gather_sum(y_rows, inverse.reshape(-1, k)).astype(y_rows.dtype)


def _sum_copies_fwd(y_rows, order, inverse, k):
    return sum_copies(y_rows, order, inverse, k), (order, inverse)


def _sum_copies_bwd(k, res, dy):
    order, _ = res
    return dy[order // k], None, None


sum_copies.defvjp(_sum_copies_fwd, _sum_copies_bwd)


@jax.custom_vjp
def combine_rows(
    y_rows: Float[Array, "copies dim"],
    weights: Float[Array, "tokens k"],
    order: Int[Array, " copies"],
    inverse: Int[Array, " copies"],
) -> Float[Array, "tokens dim"]:
    """y[t] = sum_j weights[t, j] * y_rows[inverse[t*k + j]], summed in float32 and returned in
    y_rows' dtype. The backward is gathers as well: d y_rows[r] = w[order[r]] * dy[order[r] //
    k], and d weights from the rows. Returning y_rows' dtype keeps the cotangent dy in it, so
    the backward gathers each token's dy k times in bf16 rather than in float32 (the same
    values: a float32 cotangent of a bf16 cast holds bf16 values)."""
    return _gather_sum(y_rows, inverse.reshape(weights.shape), weights).astype(y_rows.dtype)


def _combine_fwd(y_rows, weights, order, inverse):
    return combine_rows(y_rows, weights, order, inverse), (y_rows, weights, order, inverse)


def _combine_bwd(res, dy):
    y_rows, weights, order, inverse = res
    tokens, k = weights.shape
    w_rows = weights.reshape(-1)[order]
    f32 = jnp.float32
    dy_rows = dy[order // k]  # each row's token's cotangent, for d_rows and (off the CPU) d_weights
    d_rows = (dy_rows.astype(f32) * w_rows[:, None].astype(f32)).astype(y_rows.dtype)
    d_weights = _weights_grad(y_rows, dy, dy_rows, inverse, k).astype(weights.dtype)
    return d_rows, d_weights, None, None


def _weights_grad(
    y_rows: Float[Array, "copies dim"],
    dy: Float[Array, "tokens dim"],
    dy_rows: Float[Array, "copies dim"],
    inverse: Int[Array, " copies"],
    k: int,
) -> Float[Array, "tokens k"]:
    """d weights[t, j] = <y_rows[inverse[t*k + j]], dy[t]> in float32 (`dy_rows[r]` is row r's
    token's dy): `_weights_grad_by_token` on the CPU, `_weights_grad_by_row` elsewhere."""
    return jax.lax.platform_dependent(
        y_rows,
        dy,
        dy_rows,
        inverse,
        cpu=functools.partial(_weights_grad_by_token, k=k),
        default=functools.partial(_weights_grad_by_row, k=k),
    )


def _weights_grad_by_token(y_rows, dy, dy_rows, inverse, k: int):
    """Each token's k dot products (`_gathered_dots`: it fuses with its gathers on the CPU)."""
    return _gathered_dots(y_rows, inverse.reshape(-1, k), dy)


def _weights_grad_by_row(y_rows, dy, dy_rows, inverse, k: int):
    """One dot product per row of the sorted buffer, `<y_rows[r], dy_rows[r]>`, put in token
    order: `dy_rows` is the gather the backward's `d_rows` is made of, and XLA reads it once
    for both. On an H200 the two passes of the by-token form took 0.69 ms a layer at
    proxy-2b's batch 24 (docs/benchmarks.md, seventeenth run)."""
    dots = jnp.sum(dy_rows.astype(jnp.float32) * y_rows.astype(jnp.float32), axis=1)
    return dots[inverse].reshape(-1, k)


combine_rows.defvjp(_combine_fwd, _combine_bwd)


def _sort_by_expert(flat_ids: Int[Array, " copies"], n_experts: int) -> Int[Array, " copies"]:
    """The stable argsort of `flat_ids`. When it fits in int32, sorts the single key
    `id * copies + copy` instead: keys are unique, so any sort is stable, and sorting one
    array is ~4x faster on the CPU than sorting (id, index) pairs with a comparator."""
    copies = flat_ids.shape[0]
    if n_experts * copies >= 2**31:
        return jnp.argsort(flat_ids, stable=True).astype(jnp.int32)
    key = flat_ids.astype(jnp.int32) * copies + jnp.arange(copies, dtype=jnp.int32)
    return jnp.sort(key) % copies


class SortPlan(eqx.Module):
    order: Int[Array, " copies"]  # row r of the dispatched buffer holds copy order[r]
    inverse: Int[Array, " copies"]  # copy c sits in row inverse[c]


class SortDispatcher(AbstractDispatcher):
    """Stable sort by expert id; ties keep token order, so the layout is deterministic. The
    row movements are `_expand_rows` and `_combine_rows`, which a subclass may replace with
    kernels of the same values (`dropless.backends.row_gather`)."""

    supports_row_weights: ClassVar[bool] = True

    def _dispatch(self, x, routing):
        n_experts = routing.scores.shape[-1]
        flat_ids = routing.expert_ids.reshape(-1)
        order = _sort_by_expert(flat_ids, n_experts)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
        rows = self._expand_rows(x, order, inverse)
        group_sizes = expert_counts(flat_ids, n_experts)
        return Dispatched(rows=rows, group_sizes=group_sizes, plan=SortPlan(order, inverse))

    def _combine(self, y_rows, dispatched, routing):
        plan = dispatched.plan
        return self._combine_rows(y_rows, routing.weights, plan.order, plan.inverse)

    def _row_weights(self, dispatched, routing):
        plan = dispatched.plan
        weights = routing.weights.reshape(-1, 1)
        return permute_rows(weights, plan.order, plan.inverse)[:, 0]

    def _sum_copies(self, y_rows, dispatched, routing):
        plan = dispatched.plan
        return sum_copies(y_rows, plan.order, plan.inverse, routing.expert_ids.shape[1])

    def _expand_rows(self, x, order, inverse):
        return expand_rows(x, order, inverse)

    def _combine_rows(self, y_rows, weights, order, inverse):
        return combine_rows(y_rows, weights, order, inverse)


def _check_count(name: str, value, *allowed) -> None:
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


def _group_starts(group_sizes: Int[Array, " experts"]) -> Int[Array, " experts"]:
    return jnp.cumsum(group_sizes) - group_sizes


def _segments(group_sizes, skip):
    """Each group's rows from its `skip`-th on: (first row, row count) per expert."""
    return _group_starts(group_sizes) + skip, jnp.maximum(group_sizes - skip, 0)


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


def _chunked_matmul(lhs, rhs, group_sizes, chunk, skip, contract_rhs_dim, per_trip=None):
    """out[r] = lhs[r] @ rhs[e] (contract_rhs_dim=1) or lhs[r] @ rhs[e].T (=2) for the rows of
    each group from its `skip`-th on; every other row of `out` is zero. `per_trip`: see
    `_for_each_chunk`."""
    rows, width = lhs.shape
    chunk = min(chunk, rows)
    out_width = rhs.shape[3 - contract_rhs_dim]
    dims = (((1,), (contract_rhs_dim - 1,)), ((), ()))
    starts, sizes = _segments(group_sizes, skip)

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


def _slot_sources(starts, sizes, slots: int, rows: int):
    """For `slots` slots per segment: the row each slot reads (clipped into the buffer) and
    whether it holds one of the segment's rows."""
    slot = jnp.arange(slots)
    src = jnp.clip(starts[:, None] + slot[None, :], 0, rows - 1)
    return src, slot[None, :] < sizes[:, None]


def _take_slots(x, src, filled):
    """x's rows into [segments slots width], zeros in unfilled slots."""
    return jnp.where(filled[..., None], x[src], 0)


def _batched_weight_grad(
    x: Float[Array, "experts slots in_"], g: Float[Array, "experts slots out"], dtype
) -> Float[Array, "experts in_ out"]:
    """sum over slots of outer(x, g) per expert: one batched matmul whose [experts in out] output
    (the largest buffer of the backward) is written once, in `dtype` (the weights'). In bf16
    that halves the buffer against float32; the matmul still accumulates in float32, and an
    expert whose rows go past the slots is rounded once more after they are added."""
    return jnp.einsum("esi,eso->eio", x, g, preferred_element_type=dtype)


def _add_row_chunks(drhs, lhs, grad_out, starts, sizes, chunk, per_trip=None):
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
    starts, sizes = _group_starts(group_sizes), group_sizes
    if rows // n_experts <= 2 * chunk:
        slots = min(default_capacity(rows, n_experts, slot_share), rows)
        src, filled = _slot_sources(starts, sizes, slots, rows)
        drhs = _batched_weight_grad(_take_slots(lhs, src, filled), grad_out[src], dtype)
        starts, sizes = starts + slots, jnp.maximum(sizes - slots, 0)
    else:
        drhs = jnp.zeros_like(lhs, shape=(n_experts, width, grad_out.shape[1]), dtype=dtype)
    return _add_row_chunks(drhs, lhs, grad_out, starts, sizes, chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_grouped_matmul(
    lhs: Float[Array, "rows in_"],
    rhs: Float[Array, "experts in_ out"],
    group_sizes: Int[Array, " experts"],
    chunk: int,
) -> Float[Array, "rows out"]:
    """The grouped matmul of `ChunkedGroupedMatmul`, with its exact hand-written gradient."""
    return _chunked_matmul(lhs, rhs, group_sizes, chunk, 0, contract_rhs_dim=1)


def _cgmm_fwd(lhs, rhs, group_sizes, chunk):
    return chunked_grouped_matmul(lhs, rhs, group_sizes, chunk), (lhs, rhs, group_sizes)


def _cgmm_bwd(chunk, res, g):
    lhs, rhs, group_sizes = res
    # A constant cotangent (the gradient of a sum) would be sunk by XLA into the loops below
    # and re-materialised at every iteration; the barrier makes it an ordinary array.
    g = jax.lax.optimization_barrier(g.astype(lhs.dtype))
    dlhs = _chunked_matmul(g, rhs, group_sizes, chunk, 0, contract_rhs_dim=2)
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    weight_grad = functools.partial(
        _chunked_weight_grad, chunk=chunk, n_experts=rhs.shape[0], dtype=dtype
    )
    # How much of the mean group goes in the weight gradient's slots. On the CPU the slot
    # gathers sit in XLA's one temporary buffer, and glibc maps a freed block above 32 MiB
    # afresh, page by page, at every call instead of reusing it: at 256 experts of 32 rows
    # (256 in, 512 out, float32) half the mean keeps that buffer at 29.4 MB (41.9 with the
    # whole mean): skewed groups' fwd+bwd went from a median 4.11 to 3.88 times dense, balanced
    # ones from 3.49 to 3.58 (docs/benchmarks.md, "Half the slots on the CPU"). Elsewhere
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

    chunk: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        _check_count("chunk", self.chunk, None)

    def _impl(self, lhs, rhs, group_sizes):
        chunk = self.chunk or default_chunk(lhs.shape[0], rhs.shape[0])
        return chunked_grouped_matmul(lhs, rhs, group_sizes.astype(jnp.int32), chunk)


class RaggedDot(AbstractGroupedMatmul):
    """`jax.lax.ragged_dot`: exact; XLA lowers it to a dense contraction over all experts."""

    def _impl(self, lhs, rhs, group_sizes):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))


def default_capacity(rows: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert: `capacity_factor` times the mean group size, rounded up to 8."""
    mean = rows / max(n_experts, 1)
    return max(8, -(-int(math.ceil(capacity_factor * mean)) // 8) * 8)


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
        starts = _group_starts(group_sizes)
        src, filled = _slot_sources(starts, group_sizes, capacity, rows)
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
    return _take_slots(x, layout.src, layout.filled)


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
    overflow = _chunked_matmul(lhs, rhs, group_sizes, chunk, capacity, contract_rhs_dim, per_trip)
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
    drhs = _batched_weight_grad(_gather_slots(lhs, layout), _gather_slots(g, layout), dtype)
    starts, sizes = _segments(group_sizes, capacity)
    drhs = _add_row_chunks(drhs, lhs, g, starts, sizes, chunk, per_trip)
    return dlhs, drhs.astype(rhs.dtype), None


capacity_grouped_matmul.defvjp(_capacity_fwd, _capacity_bwd)


class CapacityGroupedMatmul(AbstractGroupedMatmul):
    """One batched matmul over `capacity` slots per expert, plus the chunked loop for the rows
    of any group longer than that: dropless (overflow rows are computed, never dropped) and
    one large, accelerator-friendly matmul when routing is near balance.

    Costs `capacity_factor` times the routed FLOPs in the batched part; the overflow loop runs
    only when a group exceeds its capacity.
    """

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
        _check_count("chunk", self.chunk, None)

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
