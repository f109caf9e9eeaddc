"""The forward and input-gradient kernel, `out[r] = lhs[r] @ rhs[e]` (or `@ rhs[e].T`), and its
form with the experts' SwiGLU computed in the epilogue."""

import functools
import math

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from dropless.backends.mosaic import _launch as launch
from dropless.backends.mosaic._launch import (
    ROW_ALIGN,
    check_operands,
    epilogue,
    finished_in,
    ignore,
    make_kernel,
    pad_rows,
    swizzled,
    warp_specialized,
)
from dropless.backends.mosaic._schedule import KernelConfig, chain_fits, config_for, tile_schedule


def grouped_matmul(
    lhs: Float[Array, "rows in_"],
    rhs: Float[Array, "experts _ _"],
    group_sizes: Int[Array, " experts"],
    *,
    transpose_rhs: bool = False,
    config: KernelConfig | None = None,
) -> Float[Array, "rows out"]:
    """`lhs` times each group's `rhs[e]`, `[k n]` (or `[n k]` with `transpose_rhs`), in the
    operands' dtype (bf16 or f16) with float32 accumulation."""
    rows, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    c = config or config_for(n)
    check_operands("grouped matmul", lhs, rhs, (("k", k, c.tile_k), ("n", n, 2 * c.tile_n)))
    if rows == 0:
        return jnp.zeros((0, n), lhs.dtype)
    (lhs,) = pad_rows((lhs,), c.tile_m)
    schedule, n_items = tile_schedule(group_sizes, lhs.shape[0], c.tile_m)
    out = _launch(schedule, n_items, lhs, rhs, transpose_rhs, c)
    return out[:rows]


def grouped_matmul_swiglu(
    lhs: Float[Array, "rows in_"],
    rhs: Float[Array, "experts in_ gate_up"],
    group_sizes: Int[Array, " experts"],
    *,
    row_scale: Float[Array, " rows"] | None = None,
    config: KernelConfig | None = None,
) -> tuple[Float[Array, "rows gate_up"], Float[Array, "rows hidden"]]:
    """`grouped_matmul(lhs, rhs)` and, from the same tiles before they leave the GPU's shared
    memory, `silu(gate) * up`: the SwiGLU of the experts' gate-and-up product without another
    pass over it. `rhs` holds gate and up columns interleaved in blocks of `tile_n // 2`
    (`interleave_gate_up`, same config), so each compute warpgroup's tile has a block of each;
    the first output keeps that order (for the backward), the second is in the hidden units'
    order. The SwiGLU is computed in float32 from the bf16/f16-rounded gate and up, times
    `row_scale[r]` for row r if given (read in the epilogue, float32)."""
    rows, k = lhs.shape
    n = rhs.shape[2]
    c = config or config_for(n)
    check_operands("grouped matmul", lhs, rhs, (("k", k, c.tile_k), ("n", n, 2 * c.tile_n)))
    if row_scale is not None and row_scale.shape != (rows,):
        raise ValueError(f"grouped matmul: row_scale has shape {row_scale.shape}, want ({rows},)")
    if rows == 0:
        return jnp.zeros((0, n), lhs.dtype), jnp.zeros((0, n // 2), lhs.dtype)
    if row_scale is None:
        (lhs,) = pad_rows((lhs,), c.tile_m)
    else:
        lhs, row_scale = pad_rows((lhs, row_scale.astype(jnp.float32)), c.tile_m)
    schedule, n_items = tile_schedule(group_sizes, lhs.shape[0], c.tile_m)
    gate_up, hidden = _launch(
        schedule, n_items, lhs, rhs, False, c, swiglu=True, row_scale=row_scale
    )
    return gate_up[:rows], hidden[:rows]


# Over 60 lines: one kernel launch, whose specs, pipeline and body share the tile config and
# the traced refs; its parts that stand alone are `_store_rows`, `_swiglu_epilogue` and
# `_run_chained`.
def _launch(
    schedule, n_items, lhs, rhs, transpose_rhs, c: KernelConfig, swiglu=False, row_scale=None
):
    rows, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    dtype = lhs.dtype
    cta_n = 2 * c.tile_n
    n_blocks = n // cta_n
    tiled = swizzled(dtype, c.tile_k)
    lhs_spec = plgpu.BlockSpec((c.tile_m, c.tile_k), lambda kk: (0, kk), transforms=tiled)
    if transpose_rhs:
        rhs_spec = plgpu.BlockSpec((cta_n, c.tile_k), lambda kk: (0, kk), transforms=tiled)
    else:
        rhs_spec = plgpu.BlockSpec((c.tile_k, cta_n), lambda kk: (kk, 0), transforms=tiled)

    steps = k // c.tile_k
    if not chain_fits(steps, c):
        raise ValueError(
            f"Mosaic grouped matmul: chain=True needs max_concurrent_steps="
            f"{c.max_concurrent_steps} to divide the k / tile_k = {steps} steps"
        )

    def pipeline(mma, compute_context, state=None):
        return warp_specialized(
            mma, compute_context, steps, [lhs_spec, rhs_spec], c.max_concurrent_steps, state
        )

    # Not swizzled: the store ladder slices it at any row, swizzling tiles rows by 8. With the
    # SwiGLU, each warpgroup's tile is kept as its gate and up halves, each contiguous (a TMA
    # store takes only contiguous shared memory), the hidden units then written over the gate.
    tile_shape = (2, c.tile_m, c.tile_n // 2) if swiglu else (c.tile_m, c.tile_n)

    # Over 60 lines: one kernel body; its nested scope, loop step and epilogues close over the
    # same shared-memory refs and per-tile indices.
    def body(schedule_gmem, n_items_gmem, lhs_gmem, rhs_gmem, *outs):
        if row_scale is None:
            scale_gmem, (out_gmem, *hidden_gmem) = None, outs
        else:
            scale_gmem, out_gmem, *hidden_gmem = outs
        allocs = pipeline(ignore, ignore).get_allocations(lhs_gmem, rhs_gmem.at[0])

        @functools.partial(
            pl.run_scoped,
            allocs=allocs,
            out_smem=plgpu.SMEM((2, *tile_shape), dtype),
            # each compute warpgroup's copy of its tile's row scales, loaded by TMA
            scale_smem=None if row_scale is None else plgpu.SMEM((2, c.tile_m), jnp.float32),
            scale_loaded=None if row_scale is None else plgpu.Barrier(num_barriers=2),
            collective_axes="wg",
        )
        def scope(allocs, out_smem, scale_smem, scale_loaded):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((n_items_gmem[0] * n_blocks,), collective_axes="sm")
            def step(info):
                item, col_block = plgpu.planar_snake(
                    info.index[0], (n_items_gmem[0], n_blocks), 1, c.band
                )
                group = schedule_gmem[0, item]
                row0 = schedule_gmem[1, item] * ROW_ALIGN  # lets Mosaic see the alignment
                first, end = schedule_gmem[2, item], schedule_gmem[3, item]
                cols = pl.ds(col_block * cta_n, cta_n)
                wg_cols = pl.ds(wg * c.tile_n, c.tile_n)
                weights = rhs_gmem.at[group]
                weights = weights.at[cols, :] if transpose_rhs else weights.at[:, cols]

                def mma(_, lhs_smem, rhs_smem, acc):
                    if transpose_rhs:
                        rhs_half = rhs_smem.at[wg_cols, :].transpose((1, 0))
                    else:
                        rhs_half = rhs_smem.at[:, wg_cols]
                    plgpu.wgmma(acc, lhs_smem, rhs_half)
                    plgpu.wgmma_wait(0)
                    return acc

                def store(tile, gmem=out_gmem, at_cols=wg_cols, out_cols=cols):
                    dst = gmem.at[pl.ds(row0, c.tile_m), out_cols].at[:, at_cols]
                    _store_rows(tile, dst, first, end - first, c.tile_m)

                if swiglu:
                    half = c.tile_n // 2
                    halves = [pl.ds(wg * c.tile_n + i * half, half) for i in range(2)]
                    hidden_cols = pl.ds(col_block * c.tile_n + wg * half, half)
                    compute_context = _swiglu_epilogue(
                        out_smem,
                        wg,
                        dtype,
                        c.tile_m,
                        c.tile_n,
                        lambda i, tile: store(tile, at_cols=halves[i]),
                        lambda tile: store(tile, hidden_gmem[0], pl.ds(0, half), hidden_cols),
                        None
                        if scale_gmem is None
                        else (
                            scale_gmem.at[pl.ds(row0, c.tile_m)],
                            scale_smem.at[wg],
                            scale_loaded.at[wg],
                        ),
                    )
                else:
                    compute_context = epilogue(out_smem, wg, dtype, c.tile_m, c.tile_n, store)
                refs = (lhs_gmem.at[pl.ds(row0, c.tile_m), :], weights)
                if c.chain:
                    make = functools.partial(pipeline, mma, compute_context)
                    _run_chained(make, info, *refs, allocations=allocs)
                else:
                    pipeline(mma, compute_context)(*refs, allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_shapes = [(rows, n), (rows, n // 2)] if swiglu else (rows, n)
    kernel = make_kernel(body, out_shapes, dtype)
    scale = () if row_scale is None else (row_scale,)
    return kernel(schedule, n_items, lhs, rhs, *scale)


def _run_chained(make_pipeline, info, *refs, allocations) -> None:
    """Run this thread block's `info.local_index`-th pipeline as a link of the chain of all
    its pipelines (the first starts it, the last stops it); a block with a single pipeline
    runs it unchained, since one pipeline cannot both start and stop a chain."""
    states = plgpu.PipelinePipeline
    last = info.num_local_steps - 1
    state = jnp.where(
        info.local_index == 0,
        jnp.int32(states.START),
        jnp.where(info.local_index == last, jnp.int32(states.STOP), jnp.int32(states.STEADY)),
    )

    @pl.when(last == 0)
    def _():
        make_pipeline(None)(*refs, allocations=allocations)

    @pl.when(last > 0)
    def _():
        make_pipeline(state)(*refs, allocations=allocations)


def _swiglu_epilogue(
    out_smem, wg, dtype, tile_m: int, tile_n: int, store_half, store_hidden, row_scale=None
):
    """`epilogue` for `grouped_matmul_swiglu`: the tile's gate and up halves are stored
    (`store_half(i, half)`); `silu(gate) * up` is computed from the registers while those stores
    run, then written over the gate half once its store has read it, and stored
    (`store_hidden`). `row_scale`: (the tile's rows' scales in global memory, this warpgroup's
    shared-memory copy, its barrier); the copy is issued before the pipeline runs and the
    SwiGLU multiplied by it, row by row."""
    half = tile_n // 2

    def start():
        scale_gmem, scale_smem, loaded = row_scale
        plgpu.copy_gmem_to_smem(scale_gmem, scale_smem, loaded)

    def finish(result):
        gate, up = result[:, :half], result[:, half:]
        out_smem[wg, 0] = gate
        out_smem[wg, 1] = up
        plgpu.commit_smem()
        for i in range(2):
            store_half(i, out_smem.at[wg, i])
        gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
        hidden = gate / (1.0 + jnp.exp(-gate)) * up
        if row_scale is not None:  # one value per row, broadcast along the row's columns
            _, scale_smem, loaded = row_scale
            plgpu.barrier_wait(loaded)
            scale = scale_smem[...]
            if launch.INTERPRET is None:  # the interpreter has no layouts
                scale = plgpu.layout_cast(scale, plgpu.Layout.WGMMA.reduce(1))
            hidden = hidden * lax.broadcast_in_dim(scale, (tile_m, half), [0])
        hidden = hidden.astype(dtype)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[wg, 0] = hidden
        plgpu.commit_smem()
        store_hidden(out_smem.at[wg, 0])

    return finished_in(dtype, tile_m, tile_n, finish, None if row_scale is None else start)


def _store_rows(smem, gmem, first, count, tile_m: int):
    """Copy rows [first, first + count) of a tile to the same rows of `gmem`: TMA needs a static
    row count, so one store per set bit of `count`, largest first."""
    start = first
    for bit in reversed(range(int(math.log2(tile_m)) + 1)):
        size = 1 << bit

        @pl.when(count & size != 0)
        def _(start=start, size=size):  # runs here, at trace time: the binding is for ruff
            plgpu.copy_smem_to_gmem(smem.at[pl.ds(start, size)], gmem.at[pl.ds(start, size)])

        start = start + (count & size)
