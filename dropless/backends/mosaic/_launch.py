"""The frame every Mosaic GPU kernel here shares: the launch (one thread block per SM, a memory
warpgroup and two compute warpgroups), the warp-specialised pipeline, shared-memory tiling, the
compute warpgroups' epilogue, and the checks and padding of the operands."""

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp


def group_bounds(group_sizes, rows: int):
    """Each group's first row and end row, the ends clamped to `rows`."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), rows)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]]), ends


def pad_rows(arrays, multiple: int):
    """The arrays with zero rows appended up to a multiple of `multiple`: whole row blocks keep
    every TMA load in bounds."""
    rows = arrays[0].shape[0]
    extra = -rows % multiple
    return tuple(jnp.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1)) if extra else a for a in arrays)


def warp_specialized(mma, compute_context, steps, in_specs, max_concurrent_steps: int, state=None):
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


def check_operands(what: str, a, b, rules) -> None:
    if a.dtype != b.dtype or a.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"Mosaic {what}: operands must share a 16-bit float dtype, got {a.dtype} and {b.dtype}"
        )
    for name, width, block in rules:
        if width % block:
            raise ValueError(f"Mosaic {what}: width {name}={width} must be a multiple of {block}")


# Rows of the swizzled shared-memory tiles come in groups of 8 (`swizzled`), and Mosaic's
# lowering takes a TMA load into them only from a row that is a multiple of 8.
ROW_ALIGN = 8


def swizzled(dtype, tile_k: int) -> tuple:
    """Shared-memory transforms for tiles whose minor dimension is `tile_k` (or a multiple)."""
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    return (
        plgpu.TilingTransform((ROW_ALIGN, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def make_kernel(body, out_shape, dtype):
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
        **interpret_kwargs(),
    )


def finished_in(dtype, tile_m: int, tile_n: int, finish, start=None):
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


def epilogue(out_smem, wg, dtype, tile_m: int, tile_n: int, store):
    """Write the result to this warpgroup's tile `out_smem[wg]` and `store(out_smem.at[wg])`
    it to global memory."""

    def finish(result):
        out_smem[wg] = result
        plgpu.commit_smem()
        store(out_smem.at[wg])

    return finished_in(dtype, tile_m, tile_n, finish)


def ignore(*_, **__):
    """A pipeline body for `get_allocations`: allocations do not depend on the body."""


# Tests run the kernel on the CPU through Mosaic GPU's interpreter by setting this.
INTERPRET = None


def interpret_kwargs() -> dict:
    return {} if INTERPRET is None else {"interpret": INTERPRET}
