"""A warp-specialised grouped matmul for Hopper, written in Pallas' Mosaic GPU dialect.

`out[r] = lhs[r] @ rhs[e]` for the expert-contiguous rows r of each group e (and, with
`transpose_rhs`, `lhs[r] @ rhs[e].T`, the input gradient). Two things make it fast where
JAX's `ragged_dot_mgpu` is slow with many experts:

- A tile schedule computed by XLA before the launch: one entry per row tile of each group, in
  row order, the tiles starting at the group's first row. A kernel step reads its entry (four
  scalars) instead of scanning every group boundary, which costs O(experts) per tile.
- The Hopper matmul recipe: a memory warpgroup streams `lhs` and `rhs` tiles into shared memory
  through TMA while two compute warpgroups multiply them (each a `tile_m x tile_n` half of the
  block), so loads and tensor-core work overlap.

A group's last tile usually reaches into the next group's rows. It is computed whole, and stores
only its own rows, through a ladder of power-of-two TMA stores (the row count is known only at
run time). Tiles aligned to the groups (to 8 rows) rather than to fixed row blocks take about
ceil(n / tile_m) passes for a group of n rows: with 256 experts of 256 rows on average
(Dirichlet or multinomial draws), about 640-670 passes where fixed blocks take about 765, a
block shared by two groups costing a pass for each.
Rows after the last group are computed with the last expert's weights: finite for finite input,
as the grouped-matmul contract asks. The weight gradient ignores them, which is exact because
callers ignore those rows (their output gradient is zero).
"""

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from dropless.swiglu import swiglu_grad_in_blocks


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes. A thread block computes `tile_m x 2*tile_n` outputs (one half per compute
    warpgroup), contracting `tile_k` at a time with up to `max_concurrent_steps` loads in
    flight; `band` column blocks are walked together so that concurrent blocks share weights."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 3
    band: int = 4
    # Chain the row blocks' pipelines: the memory warpgroup loads the next block while the
    # compute warpgroups finish and store this one, so no bubble between blocks. JAX allows it
    # only when `max_concurrent_steps` divides the steps (`k / tile_k`).
    chain: bool = False

    def __post_init__(self):
        if self.tile_m & (self.tile_m - 1):
            raise ValueError(f"KernelConfig.tile_m={self.tile_m} must be a power of two")


def config_for(out_width: int) -> KernelConfig:
    """Tiles for an output `out_width` wide. Chosen on an H200 (docs/benchmarks.md): 2 x 128
    columns per block with 3 loads in flight is fastest at DeepSeek-V3 widths; shared memory
    (227 KiB) allows no 4th. Widths that 256 does not divide get 2 x 64 columns."""
    if out_width % 256:
        return KernelConfig(tile_n=64, max_concurrent_steps=4, band=8)
    return KernelConfig()


def tile_schedule(
    group_sizes: Int[Array, " experts"], rows: int, tile_m: int
) -> tuple[Int[Array, "4 slots"], Int[Array, "1"]]:
    """Work items of the row loop, in row order: (group, the tile's first row / `ROW_ALIGN`,
    first, end), the last two as offsets within the tile; and how many items are real. Each
    group's tiles start at its first row, rounded down to a multiple of `ROW_ALIGN`, so a group
    of n rows takes about ceil(n / tile_m) items. A tile that would run past `rows` is moved
    back to end there. The last group is stretched to cover every row to `rows`. `slots` = row
    blocks + groups - 1 bounds the item count."""
    n_groups = group_sizes.shape[0]
    n_blocks = -(-rows // tile_m)
    slots = n_blocks + n_groups - 1
    starts, ends = _group_bounds(group_sizes, rows)
    ends = ends.at[-1].set(rows)
    aligned = starts // ROW_ALIGN * ROW_ALIGN
    tiles = jnp.where(ends > starts, -(-(ends - aligned) // tile_m), 0)
    items_before = jnp.cumsum(tiles)
    item = jnp.arange(slots, dtype=jnp.int32)
    # compare_all: one elementwise kernel, where the default method is a loop of log2(groups)
    # trips, each a few small kernels on a GPU
    owner = jnp.searchsorted(items_before, item, side="right", method="compare_all")
    group = jnp.minimum(owner, n_groups - 1)
    tile_row = aligned[group] + (item - (items_before[group] - tiles[group])) * tile_m
    row0 = jnp.minimum(tile_row, rows - tile_m)  # rows >= tile_m: every load in bounds
    first = jnp.maximum(tile_row, starts[group]) - row0
    end = jnp.clip(ends[group] - row0, first, tile_m)
    schedule = jnp.stack([group, row0 // ROW_ALIGN, first, end]).astype(jnp.int32)
    return schedule, items_before[-1:].astype(jnp.int32)


def matmul_fits(k: int, n: int, config: KernelConfig | None = None) -> bool:
    """Whether `grouped_matmul` with these settings runs a contraction over `k` into `n`
    columns: the tiles divide both widths and, chained, the stages divide the steps."""
    c = config or config_for(n)
    return k % c.tile_k == 0 and n % (2 * c.tile_n) == 0 and _chain_fits(k // c.tile_k, c)


def _chain_fits(steps: int, c: KernelConfig) -> bool:
    return not c.chain or steps % c.max_concurrent_steps == 0


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
    _check("grouped matmul", lhs, rhs, (("k", k, c.tile_k), ("n", n, 2 * c.tile_n)))
    if rows == 0:
        return jnp.zeros((0, n), lhs.dtype)
    (lhs,) = _pad_rows((lhs,), c.tile_m)
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
    _check("grouped matmul", lhs, rhs, (("k", k, c.tile_k), ("n", n, 2 * c.tile_n)))
    if row_scale is not None and row_scale.shape != (rows,):
        raise ValueError(f"grouped matmul: row_scale has shape {row_scale.shape}, want ({rows},)")
    if rows == 0:
        return jnp.zeros((0, n), lhs.dtype), jnp.zeros((0, n // 2), lhs.dtype)
    if row_scale is None:
        (lhs,) = _pad_rows((lhs,), c.tile_m)
    else:
        lhs, row_scale = _pad_rows((lhs, row_scale.astype(jnp.float32)), c.tile_m)
    schedule, n_items = tile_schedule(group_sizes, lhs.shape[0], c.tile_m)
    gate_up, hidden = _launch(
        schedule, n_items, lhs, rhs, False, c, swiglu=True, row_scale=row_scale
    )
    return gate_up[:rows], hidden[:rows]


def interleave_gate_up(
    w_gate: Float[Array, "*lead in_ hidden"],
    w_up: Float[Array, "*lead in_ hidden"],
    config: KernelConfig | None = None,
) -> Float[Array, "*lead in_ gate_up"]:
    """Gate and up side by side in blocks of `tile_n // 2` columns (gate block 0, up block 0,
    gate block 1, ...) along the last axis: the weights' layout that `grouped_matmul_swiglu`
    takes, and the order of its gate-and-up output. `split_gate_up` undoes it."""
    *lead, hidden = w_gate.shape
    block = _interleave_block(hidden, config)
    blocks = [w.reshape(*lead, hidden // block, 1, block) for w in (w_gate, w_up)]
    return jnp.concatenate(blocks, axis=-2).reshape(*lead, 2 * hidden)


def split_gate_up(
    gate_up: Float[Array, "*lead gate_up"], config: KernelConfig | None = None
) -> tuple[Float[Array, "*lead hidden"], Float[Array, "*lead hidden"]]:
    """The gate and up halves of an `interleave_gate_up` layout, each in its own order."""
    *lead, width = gate_up.shape
    block = _interleave_block(width // 2, config)
    pairs = gate_up.reshape(*lead, width // 2 // block, 2, block)
    return pairs[..., 0, :].reshape(*lead, width // 2), pairs[..., 1, :].reshape(*lead, width // 2)


def swiglu_grad_interleaved(
    gate_up: Float[Array, "rows gate_up"],
    d_hidden: Float[Array, "rows hidden"],
    config: KernelConfig | None = None,
    *,
    row_scale: Float[Array, " rows"] | None = None,
) -> tuple[Float[Array, "rows gate_up"], Float[Array, " rows"] | None]:
    """The gradients of `silu(gate) * up` (times `row_scale[r]` per row, if given) with
    respect to an `interleave_gate_up`-ordered `gate_up`, in that order, and to `row_scale`
    (None without one), float32, in one pass (`dropless.swiglu.swiglu_grad_in_blocks`)."""
    block = _interleave_block(gate_up.shape[1] // 2, config)
    return swiglu_grad_in_blocks(gate_up, d_hidden, block, row_scale)


def _interleave_block(hidden: int, config: KernelConfig | None) -> int:
    """Half a compute warpgroup's tile: the kernel's gate and up blocks (`config`, or the one
    `config_for` picks for the 2 * hidden output columns)."""
    block = (config or config_for(2 * hidden)).tile_n // 2
    if hidden % block:
        raise ValueError(f"interleaved gate and up: hidden={hidden} must be a multiple of {block}")
    return block


def _launch(
    schedule, n_items, lhs, rhs, transpose_rhs, c: KernelConfig, swiglu=False, row_scale=None
):
    rows, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    dtype = lhs.dtype
    cta_n = 2 * c.tile_n
    n_blocks = n // cta_n
    tiled = _swizzled(dtype, c.tile_k)
    lhs_spec = plgpu.BlockSpec((c.tile_m, c.tile_k), lambda kk: (0, kk), transforms=tiled)
    if transpose_rhs:
        rhs_spec = plgpu.BlockSpec((cta_n, c.tile_k), lambda kk: (0, kk), transforms=tiled)
    else:
        rhs_spec = plgpu.BlockSpec((c.tile_k, cta_n), lambda kk: (kk, 0), transforms=tiled)

    steps = k // c.tile_k
    if not _chain_fits(steps, c):
        raise ValueError(
            f"Mosaic grouped matmul: chain=True needs max_concurrent_steps="
            f"{c.max_concurrent_steps} to divide the k / tile_k = {steps} steps"
        )

    def pipeline(mma, compute_context, state=None):
        return _warp_specialized(
            mma, compute_context, steps, [lhs_spec, rhs_spec], c.max_concurrent_steps, state
        )

    # Not swizzled: the store ladder slices it at any row, swizzling tiles rows by 8. With the
    # SwiGLU, each warpgroup's tile is kept as its gate and up halves, each contiguous (a TMA
    # store takes only contiguous shared memory), the hidden units then written over the gate.
    tile_shape = (2, c.tile_m, c.tile_n // 2) if swiglu else (c.tile_m, c.tile_n)

    def body(schedule_gmem, n_items_gmem, lhs_gmem, rhs_gmem, *outs):
        if row_scale is None:
            scale_gmem, (out_gmem, *hidden_gmem) = None, outs
        else:
            scale_gmem, out_gmem, *hidden_gmem = outs
        allocs = pipeline(_ignore, _ignore).get_allocations(lhs_gmem, rhs_gmem.at[0])

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
                        rhs_half = plgpu.transpose_ref(rhs_smem.at[wg_cols, :], (1, 0))
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
                    compute_context = _epilogue(out_smem, wg, dtype, c.tile_m, c.tile_n, store)
                refs = (lhs_gmem.at[pl.ds(row0, c.tile_m), :], weights)
                if c.chain:
                    make = functools.partial(pipeline, mma, compute_context)
                    _run_chained(make, info, *refs, allocations=allocs)
                else:
                    pipeline(mma, compute_context)(*refs, allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_shapes = [(rows, n), (rows, n // 2)] if swiglu else (rows, n)
    kernel = _kernel(body, out_shapes, dtype)
    scale = () if row_scale is None else (row_scale,)
    return kernel(schedule, n_items, lhs, rhs, *scale)


def _group_bounds(group_sizes, rows: int):
    """Each group's first row and end row, the ends clamped to `rows`."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), rows)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]]), ends


def _pad_rows(arrays, multiple: int):
    """The arrays with zero rows appended up to a multiple of `multiple`: whole row blocks keep
    every TMA load in bounds."""
    rows = arrays[0].shape[0]
    extra = -rows % multiple
    return tuple(jnp.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1)) if extra else a for a in arrays)


def _warp_specialized(mma, compute_context, steps, in_specs, max_concurrent_steps: int, state=None):
    """A pipeline of `steps` over `in_specs`: one memory warpgroup loads, two compute.
    `state`: this pipeline's place in a chain of them (`_run_chained`), or None."""
    return plgpu.emit_pipeline_warp_specialized(
        mma,
        grid=(steps,),
        memory_registers=40,
        in_specs=in_specs,
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=max_concurrent_steps,
        compute_context=compute_context,
        pipeline_state=state,
    )


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


def _check(what: str, a, b, rules) -> None:
    if a.dtype != b.dtype or a.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"Mosaic {what}: operands must share a 16-bit float dtype, got {a.dtype} and {b.dtype}"
        )
    for name, width, block in rules:
        if width % block:
            raise ValueError(f"Mosaic {what}: width {name}={width} must be a multiple of {block}")


# Rows of the swizzled shared-memory tiles come in groups of 8 (`_swizzled`), and Mosaic's
# lowering takes a TMA load into them only from a row that is a multiple of 8.
ROW_ALIGN = 8


def _swizzled(dtype, tile_k: int) -> tuple:
    """Shared-memory transforms for tiles whose minor dimension is `tile_k` (or a multiple)."""
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    return (
        plgpu.TilingTransform((ROW_ALIGN, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def _kernel(body, out_shape, dtype):
    """One thread block per SM, each a memory warpgroup and two compute warpgroups ("wg").
    `out_shape`: one output's shape, or a list of shapes for as many outputs."""
    if isinstance(out_shape, list):
        out_type = [jax.ShapeDtypeStruct(shape, dtype) for shape in out_shape]
    else:
        out_type = jax.ShapeDtypeStruct(out_shape, dtype)
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(getattr(jax.devices()[0], "core_count", None) or 4,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **_interpret_kwargs(),
    )


def _finished_in(dtype, tile_m: int, tile_n: int, finish, start=None):
    """The compute warpgroups' side of a pipeline: `start()` if given (before the pipeline,
    e.g. to issue an epilogue's loads), run the pipeline into a float32 accumulator, then,
    once the previous item's stores have read this warpgroup's shared memory, hand the result
    in `dtype` to `finish` (which writes and stores it)."""

    def compute_context(run):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _(acc):
            if start is not None:
                start()
            run(acc)
            result = acc[...].astype(dtype)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            finish(result)

    return compute_context


def _epilogue(out_smem, wg, dtype, tile_m: int, tile_n: int, store):
    """Write the result to this warpgroup's tile `out_smem[wg]` and `store(out_smem.at[wg])`
    it to global memory."""

    def finish(result):
        out_smem[wg] = result
        plgpu.commit_smem()
        store(out_smem.at[wg])

    return _finished_in(dtype, tile_m, tile_n, finish)


def _swiglu_epilogue(
    out_smem, wg, dtype, tile_m: int, tile_n: int, store_half, store_hidden, row_scale=None
):
    """`_epilogue` for `grouped_matmul_swiglu`: the tile's gate and up halves are stored
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
            if INTERPRET is None:  # the interpreter has no layouts
                scale = plgpu.layout_cast(scale, plgpu.Layout.WGMMA.reduce(1))
            hidden = hidden * lax.broadcast_in_dim(scale, (tile_m, half), [0])
        hidden = hidden.astype(dtype)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[wg, 0] = hidden
        plgpu.commit_smem()
        store_hidden(out_smem.at[wg, 0])

    return _finished_in(dtype, tile_m, tile_n, finish, None if row_scale is None else start)


def _ignore(*_, **__):
    """A pipeline body for `get_allocations`: allocations do not depend on the body."""


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


# Tests run the kernel on the CPU through Mosaic GPU's interpreter by setting this.
INTERPRET = None


def _interpret_kwargs() -> dict:
    return {} if INTERPRET is None else {"interpret": INTERPRET}


@dataclasses.dataclass(frozen=True)
class WeightGradConfig:
    """Tiles of the weight gradient: a thread block computes `2*tile_m x tile_n` of a `[k n]`
    gradient (one `tile_m` half per compute warpgroup), walking rows `tile_k` at a time. `band`
    as in `KernelConfig`: 16 was the fastest of 4 / 8 / 16 on an H200 at DeepSeek-V3 widths,
    most with 256 small experts (docs/benchmarks.md).

    `segment_steps`: a thread block walks the rows of a run of consecutive experts (about this
    many `tile_k` chunks, in a power-of-two number of runs) in one pipeline, storing each
    expert's tile when its rows end; so a small expert costs no pipeline fill and drain of its
    own. None: one pipeline per expert and tile."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 3
    band: int = 16
    segment_steps: int | None = None

    def __post_init__(self):
        if self.segment_steps is not None and self.segment_steps < 1:
            raise ValueError(
                f"WeightGradConfig.segment_steps={self.segment_steps} must be None or >= 1"
            )


def weight_grad_config_for(rows: int, n_groups: int) -> WeightGradConfig:
    """The weight gradient's settings for `rows` over `n_groups`. Chosen on an H200 by kernel
    time (docs/benchmarks.md): runs of 64 chunks where experts average at most 512 rows (at
    256, +4-7% balanced and +18-31% Dirichlet over one pipeline per expert; at 512, -5% and
    +8%); one pipeline per expert above (3-21% faster there, except 1% slower at 2048
    Dirichlet)."""
    if rows <= 512 * n_groups:
        return WeightGradConfig(segment_steps=64)
    return WeightGradConfig()


def weight_grad_fits(k: int, n: int, config: WeightGradConfig | None = None) -> bool:
    """Whether the weight-gradient tiles divide a `[k n]` weight."""
    c = config or WeightGradConfig()
    return k % (2 * c.tile_m) == 0 and n % c.tile_n == 0


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
    _check("weight gradient", lhs, grad, (("k", k, 2 * c.tile_m), ("n", n, c.tile_n)))
    if rows == 0:
        return jnp.zeros((group_sizes.shape[0], k, n), lhs.dtype)
    lhs, grad = _pad_rows((lhs, grad), c.tile_k)
    bounds = jnp.stack(_group_bounds(group_sizes, rows))
    if c.segment_steps is not None:
        segments = _segment_count(lhs.shape[0], group_sizes.shape[0], c)
        first_groups = expert_segments(group_sizes, rows, segments)
        return _launch_segmented_weight_grad(bounds, first_groups, lhs, grad, c)
    return _launch_weight_grad(bounds, lhs, grad, group_sizes.shape[0], c)


def _segment_count(rows: int, n_groups: int, c: WeightGradConfig) -> int:
    """A power of two (equal runs of a power-of-two expert count), at most one per expert."""
    runs = max(1, min(n_groups, rows // c.tile_k // c.segment_steps))
    return 1 << (runs.bit_length() - 1)


def expert_segments(
    group_sizes: Int[Array, " experts"], rows: int, segments: int
) -> Int[Array, " segments_plus_1"]:
    """The first group of each of `segments` runs of consecutive groups, and the group count at
    the end: a run starts at the first group that starts at or past its share of the rows, so
    the runs hold about even rows (a group larger than a share leaves some runs empty)."""
    starts, ends = _group_bounds(group_sizes, rows)
    share = ends[-1] * jnp.arange(segments + 1) // segments
    first = jnp.searchsorted(starts, share, side="left", method="compare_all")
    return first.at[0].set(0).at[-1].set(group_sizes.shape[0]).astype(jnp.int32)


def _chunk_pipeline(mma, compute_context, first_chunk, n_steps, *, dtype, c: WeightGradConfig):
    """The weight gradient's pipeline: `n_steps` chunks of `tile_k` rows from `first_chunk` on,
    of a `2*tile_m`-column band of `lhs` and a `tile_n`-column band of `grad`."""
    chunk = lambda r: (first_chunk + r, 0)  # noqa: E731
    tiled = _swizzled(dtype, c.tile_k)
    specs = [
        plgpu.BlockSpec((c.tile_k, 2 * c.tile_m), chunk, transforms=tiled),
        plgpu.BlockSpec((c.tile_k, c.tile_n), chunk, transforms=tiled),
    ]
    return _warp_specialized(mma, compute_context, n_steps, specs, c.max_concurrent_steps)


def _chunk_pipeline_allocations(lhs_gmem, grad_gmem, c: WeightGradConfig):
    # A traced step count, as in the real pipelines: a static 1 would allocate one stage.
    pipeline = _chunk_pipeline(_ignore, _ignore, 0, jnp.int32(1), dtype=lhs_gmem.dtype, c=c)
    return pipeline.get_allocations(lhs_gmem, grad_gmem)


def _for_each_weight_tile(
    lhs_gmem, grad_gmem, units: int, m_blocks: int, n_blocks: int, c: WeightGradConfig
):
    """The frame of both weight-gradient kernels: shared memory for the chunk pipeline and the
    output tiles, and a loop over every (unit, row block, column block) of the output, spread
    over the SMs in bands of `c.band` column blocks. Decorates `step(unit, row_block,
    col_block, wg, allocs, out_smem)`; a unit is a group or a run of groups."""

    dtype = lhs_gmem.dtype
    tiled = _swizzled(dtype, c.tile_k)

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
                plgpu.wgmma(acc, plgpu.transpose_ref(half, (1, 0)), grad_smem)
                plgpu.wgmma_wait(0)
                return acc

            cols = pl.ds(col_block * c.tile_n, c.tile_n)

            def store(tile):
                weight_rows = pl.ds(row_block * cta_m + wg * c.tile_m, c.tile_m)
                plgpu.copy_smem_to_gmem(tile, out_gmem.at[group, weight_rows, cols])

            compute_context = _epilogue(out_smem, wg, dtype, c.tile_m, c.tile_n, store)
            pipeline(mma, compute_context, first_chunk, n_chunks)(
                lhs_gmem.at[:, pl.ds(row_block * cta_m, cta_m)],
                grad_gmem.at[:, cols],
                allocations=allocs,
            )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = _kernel(body, (n_groups, k, n), dtype)
    return kernel(bounds, lhs, grad)


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

            def mma(idx, lhs_smem, grad_smem, carry):
                acc, group, group_end = carry  # the group of the chunk's first rows
                half = lhs_smem.at[:, wg_rows]
                chunk0 = (first_chunk + idx[0]) * c.tile_k
                chunk_end = chunk0 + c.tile_k
                lo = jnp.clip(seg_start - chunk0, 0, c.tile_k)
                inside = (lo == 0) & (group_end > chunk_end)

                @pl.when(inside)
                def _():
                    plgpu.wgmma(acc, plgpu.transpose_ref(half, (1, 0)), grad_smem)
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
                        plgpu.wgmma(acc, plgpu.transpose_ref(half, (1, 0)), grad_smem)
                        plgpu.wgmma_wait(0)

                def ends_here(loop):
                    _, g, g_end = loop
                    return (g < g1) & (g_end <= chunk_end)

                def finish_group(loop):
                    first, g, g_end = loop
                    add_rows(first, g_end - chunk0)
                    store(acc, g)
                    return jnp.maximum(first, g_end - chunk0), g + 1, end_of(g + 1)

                first, group, group_end = lax.while_loop(
                    ends_here, finish_group, (lo, group, group_end)
                )

                @pl.when(~inside & (group < g1))
                def _():
                    add_rows(first, c.tile_k)  # the rest is the next group's

                return acc, group, group_end

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

    kernel = _kernel(body, (n_groups, k, n), dtype)
    return kernel(bounds, first_groups, lhs, grad)


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
