"""The weight-gradient kernel: `lhs[rows of e].T @ grad[rows of e]` for every group e, one
pipeline per expert or per run of consecutive experts. Its settings and the runs of experts:
`weight_grad_schedule`."""

import functools

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from dropless.backends.mosaic._launch import (
    check_operands,
    epilogue,
    group_bounds,
    ignore,
    make_kernel,
    pad_rows,
    swizzled,
    warp_specialized,
)
from dropless.backends.mosaic._weight_grad_schedule import (
    WeightGradConfig,
    expert_segments,
    weight_grad_config_for,
)


def grouped_weight_grad(
    lhs: Float[Array, "rows in_"],
    grad: Float[Array, "rows out"],
    group_sizes: Int[Array, " experts"],
    *,
    config: WeightGradConfig | None = None,
) -> Float[Array, "experts in_ out"]:
    """`lhs[rows of e].T @ grad[rows of e]` for every group e (zeros for an empty group), in
    the operands' dtype with float32 accumulation. Rows past the last group are ignored."""
    rows, k = lhs.shape
    c = config or weight_grad_config_for(rows, group_sizes.shape[0])
    n = grad.shape[1]
    check_operands("weight gradient", lhs, grad, (("k", k, 2 * c.tile_m), ("n", n, c.tile_n)))
    if rows == 0:
        return jnp.zeros((group_sizes.shape[0], k, n), lhs.dtype)
    lhs, grad = pad_rows((lhs, grad), c.tile_k)
    bounds = jnp.stack(group_bounds(group_sizes, rows))
    if c.segment_steps is not None:
        segments = _segment_count(lhs.shape[0], group_sizes.shape[0], c)
        first_groups = expert_segments(group_sizes, rows, segments)
        return _launch_segmented_weight_grad(bounds, first_groups, lhs, grad, c)
    return _launch_weight_grad(bounds, lhs, grad, group_sizes.shape[0], c)


def _segment_count(rows: int, n_groups: int, c: WeightGradConfig) -> int:
    """A power of two (equal runs of a power-of-two expert count), at most one per expert."""
    runs = max(1, min(n_groups, rows // c.tile_k // c.segment_steps))
    return 1 << (runs.bit_length() - 1)


def _chunk_pipeline(mma, compute_context, first_chunk, n_steps, *, dtype, c: WeightGradConfig):
    """The weight gradient's pipeline: `n_steps` chunks of `tile_k` rows from `first_chunk` on,
    of a `2*tile_m`-column band of `lhs` and a `tile_n`-column band of `grad`."""
    chunk = lambda r: (first_chunk + r, 0)  # noqa: E731
    tiled = swizzled(dtype, c.tile_k)
    specs = [
        plgpu.BlockSpec((c.tile_k, 2 * c.tile_m), chunk, transforms=tiled),
        plgpu.BlockSpec((c.tile_k, c.tile_n), chunk, transforms=tiled),
    ]
    return warp_specialized(mma, compute_context, n_steps, specs, c.max_concurrent_steps)


def _chunk_pipeline_allocations(lhs_gmem, grad_gmem, c: WeightGradConfig):
    # A traced step count, as in the real pipelines: a static 1 would allocate one stage.
    pipeline = _chunk_pipeline(ignore, ignore, 0, jnp.int32(1), dtype=lhs_gmem.dtype, c=c)
    return pipeline.get_allocations(lhs_gmem, grad_gmem)


def _for_each_weight_tile(
    lhs_gmem, grad_gmem, units: int, m_blocks: int, n_blocks: int, c: WeightGradConfig
):
    """The frame of both weight-gradient kernels: shared memory for the chunk pipeline and the
    output tiles, and a loop over every (unit, row block, column block) of the output, spread
    over the SMs in bands of `c.band` column blocks. Decorates `step(unit, row_block,
    col_block, wg, allocs, out_smem)`; a unit is a group or a run of groups."""

    dtype = lhs_gmem.dtype
    tiled = swizzled(dtype, c.tile_k)

    def decorate(step):
        @functools.partial(
            pl.run_scoped,
            allocs=_chunk_pipeline_allocations(lhs_gmem, grad_gmem, c),
            out_smem=plgpu.SMEM((2, c.tile_m, c.tile_n), dtype, transforms=tiled),
            collective_axes="wg",
        )
        def scope(allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((units * m_blocks * n_blocks,), collective_axes="sm")
            def _(info):
                tile, col_block = plgpu.planar_snake(
                    info.index[0], (units * m_blocks, n_blocks), 1, c.band
                )
                step(tile // m_blocks, tile % m_blocks, col_block, wg, allocs, out_smem)

        return step

    return decorate


def _launch_weight_grad(bounds, lhs, grad, n_groups: int, c: WeightGradConfig):
    rows, k = lhs.shape
    n = grad.shape[1]
    dtype = lhs.dtype
    cta_m = 2 * c.tile_m
    m_blocks, n_blocks = k // cta_m, n // c.tile_n
    pipeline = functools.partial(_chunk_pipeline, dtype=dtype, c=c)

    def body(bounds_gmem, lhs_gmem, grad_gmem, out_gmem):
        @_for_each_weight_tile(lhs_gmem, grad_gmem, n_groups, m_blocks, n_blocks, c)
        def step(group, row_block, col_block, wg, allocs, out_smem):
            start, end = bounds_gmem[0, group], bounds_gmem[1, group]
            # An empty group still walks one chunk, all of it masked: its gradient is zero.
            # The clamp keeps that chunk inside the array for empty groups at the end.
            first_chunk = jnp.minimum(start // c.tile_k, rows // c.tile_k - 1)
            n_chunks = jnp.maximum(-(-end // c.tile_k) - first_chunk, 1)
            wg_rows = pl.ds(wg * c.tile_m, c.tile_m)

            def mma(idx, lhs_smem, grad_smem, acc):
                half = lhs_smem.at[:, wg_rows]
                row0 = (first_chunk + idx[0]) * c.tile_k
                _mask_rows(half, start - row0, end - row0, c.tile_k, c.tile_m, dtype)
                plgpu.wgmma(acc, half.transpose((1, 0)), grad_smem)
                plgpu.wgmma_wait(0)
                return acc

            cols = pl.ds(col_block * c.tile_n, c.tile_n)

            def store(tile):
                weight_rows = pl.ds(row_block * cta_m + wg * c.tile_m, c.tile_m)
                plgpu.copy_smem_to_gmem(tile, out_gmem.at[group, weight_rows, cols])

            compute_context = epilogue(out_smem, wg, dtype, c.tile_m, c.tile_n, store)
            pipeline(mma, compute_context, first_chunk, n_chunks)(
                lhs_gmem.at[:, pl.ds(row_block * cta_m, cta_m)],
                grad_gmem.at[:, cols],
                allocations=allocs,
            )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = make_kernel(body, (n_groups, k, n), dtype)
    return kernel(bounds, lhs, grad)


# Over 60 lines: one kernel body, whose closures (`store`, the pipeline's context) share the
# tile's traced values; its chunk step is `_segment_mma`.
def _launch_segmented_weight_grad(bounds, first_groups, lhs, grad, c: WeightGradConfig):
    """`grouped_weight_grad` with one pipeline per (run of groups, output tile) over the run's
    `tile_k`-row chunks. A chunk inside the current group is multiplied as it is; a chunk
    where groups end is multiplied once per group, masked to its rows (from a register copy),
    and each group that ends there has its tile stored and the accumulator cleared."""
    rows, k = lhs.shape
    n = grad.shape[1]
    n_groups = bounds.shape[1]
    n_chunks = rows // c.tile_k
    dtype = lhs.dtype
    segments = first_groups.shape[0] - 1
    cta_m = 2 * c.tile_m
    m_blocks, n_blocks = k // cta_m, n // c.tile_n
    pipeline = functools.partial(_chunk_pipeline, dtype=dtype, c=c)

    def body(bounds_gmem, first_groups_gmem, lhs_gmem, grad_gmem, out_gmem):
        @_for_each_weight_tile(lhs_gmem, grad_gmem, segments, m_blocks, n_blocks, c)
        def step(segment, row_block, col_block, wg, allocs, out_smem):
            g0, g1 = first_groups_gmem[segment], first_groups_gmem[segment + 1]
            end_of = lambda g: bounds_gmem[1, jnp.minimum(g, n_groups - 1)]  # noqa: E731
            seg_start = bounds_gmem[0, jnp.minimum(g0, n_groups - 1)]
            first_chunk = jnp.minimum(seg_start // c.tile_k, n_chunks - 1)
            # At least one chunk, so that a run of empty groups still stores their zeros.
            n_steps = jnp.maximum(-(-end_of(g1 - 1) // c.tile_k) - first_chunk, 1)
            wg_rows = pl.ds(wg * c.tile_m, c.tile_m)
            cols = pl.ds(col_block * c.tile_n, c.tile_n)
            weight_rows = pl.ds(row_block * cta_m + wg * c.tile_m, c.tile_m)

            def store(acc, g):
                result = acc[...].astype(dtype)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_smem[wg] = result
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[g, weight_rows, cols])
                acc[...] = jnp.zeros((c.tile_m, c.tile_n), jnp.float32)

            mma = _segment_mma(
                first_chunk=first_chunk,
                seg_start=seg_start,
                g1=g1,
                end_of=end_of,
                store=store,
                wg_rows=wg_rows,
                dtype=dtype,
                c=c,
            )

            def compute_context(run):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
                def _(acc):
                    run((acc, g0, end_of(g0)))

            @pl.when(g1 > g0)
            def _():
                pipeline(mma, compute_context, first_chunk, n_steps)(
                    lhs_gmem.at[:, pl.ds(row_block * cta_m, cta_m)],
                    grad_gmem.at[:, cols],
                    allocations=allocs,
                )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = make_kernel(body, (n_groups, k, n), dtype)
    return kernel(bounds, first_groups, lhs, grad)


def _segment_mma(*, first_chunk, seg_start, g1, end_of, store, wg_rows, dtype, c: WeightGradConfig):
    """The pipeline step of `_launch_segmented_weight_grad` for a run of groups that ends
    before group `g1`: its carry is (accumulator, the group of the chunk's first rows, that
    group's end row); `store(acc, g)` writes group g's tile and clears the accumulator."""

    def mma(idx, lhs_smem, grad_smem, carry):
        acc, group, group_end = carry  # the group of the chunk's first rows
        half = lhs_smem.at[:, wg_rows]
        chunk0 = (first_chunk + idx[0]) * c.tile_k
        chunk_end = chunk0 + c.tile_k
        lo = jnp.clip(seg_start - chunk0, 0, c.tile_k)
        inside = (lo == 0) & (group_end > chunk_end)

        @pl.when(inside)
        def _():
            plgpu.wgmma(acc, half.transpose((1, 0)), grad_smem)
            plgpu.wgmma_wait(0)

        # Otherwise the rows are split between groups: keep a copy to mask from.
        shape = (c.tile_k, c.tile_m)
        x = lax.cond(inside, lambda: jnp.zeros(shape, dtype), lambda: half[...])
        row = _row_index(shape)

        def add_rows(first, end):  # acc += this chunk's rows [first, end)
            @pl.when(end > first)
            def _():
                half[...] = x * ((row >= first) & (row < end)).astype(dtype)
                plgpu.commit_smem()
                plgpu.wgmma(acc, half.transpose((1, 0)), grad_smem)
                plgpu.wgmma_wait(0)

        def ends_here(loop):
            _, g, g_end = loop
            return (g < g1) & (g_end <= chunk_end)

        def finish_group(loop):
            first, g, g_end = loop
            add_rows(first, g_end - chunk0)
            store(acc, g)
            return jnp.maximum(first, g_end - chunk0), g + 1, end_of(g + 1)

        first, group, group_end = lax.while_loop(ends_here, finish_group, (lo, group, group_end))

        @pl.when(~inside & (group < g1))
        def _():
            add_rows(first, c.tile_k)  # the rest is the next group's

        return acc, group, group_end

    return mma


def _mask_rows(half, first, end, tile_k: int, tile_m: int, dtype) -> None:
    """Zero the rows of a `[tile_k tile_m]` shared-memory chunk outside [first, end): they
    belong to neighbouring groups. (So a non-finite value in a neighbour's rows of the other
    operand gives NaN, as in JAX's transposed_ragged_dot; zeroing that one too needs a
    barrier.)"""

    @pl.when((first > 0) | (end < tile_k))
    def _():
        row = _row_index((tile_k, tile_m))
        keep = ((row >= first) & (row < end)).astype(dtype)
        half[...] = half[...] * keep
        plgpu.commit_smem()


def _row_index(shape):
    """Each element's row in a `shape` register tile laid out as `wgmma` operands are."""
    return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, shape, 0), plgpu.Layout.WGMMA)
