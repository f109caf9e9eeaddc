"""The sort dispatcher's row gathers as a Pallas kernel (Triton lowering), for GPUs.

Two gathers of `tokens * k` rows run at every MoE layer: the dispatch's expansion
`x[order // k]` and the combine's backward `dy[order // k] * w`. XLA writes bf16 rows at about
half the bytes per second of float32 ones on an H200 (docs/benchmarks.md, fourteenth run); the
kernel loads and stores whole tiles of `BLOCK_ROWS` rows by `column_block(dim)` columns instead,
and for the combine's backward can also compute the routing weights' gradient (each row's dot
product with the gathered `dy`) while the row is loaded. Values are those of `SortDispatcher`
bitwise, except the weights' gradient, whose float32 dot products sum in another order. On an
H200 the expansion is faster than XLA's, the fused backward slower than XLA's own one-pass
fusion of the same two outputs (docs/benchmarks.md, seventeenth run), so `PallasSortDispatcher`
uses the kernel for the expansion and leaves the backward to XLA unless asked.
"""

import functools
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from dropless.backends import jnp as jnp_backend

BLOCK_ROWS = 32  # rows per program: a [32 1024] bf16 tile is 64 KiB,
MAX_COLUMNS = 1024
NUM_WARPS = 8  # 256 B of it per thread (512 B as float32 when scaled)


def column_block(dim: int) -> int:
    """The columns a program moves: the largest power of two dividing `dim`, at most
    `MAX_COLUMNS` (Triton's blocks have power-of-two sizes; 7168 = 7 x 1024)."""
    return min(dim & -dim, MAX_COLUMNS)


def gather_rows(
    x: Float[Array, "n dim"],
    index: Int[Array, " rows"],
    scale: Float[Array, " rows"] | None = None,
    dot_with: Float[Array, "rows dim"] | None = None,
    *,
    interpret: bool = False,
):
    """`x[index]`, or `(x[index] * scale[:, None])` rounded to x's dtype. With `dot_with`, also
    `<x[index[r]], dot_with[r]>` per row in float32 (before scaling): `(rows, dots)`.
    `len(index)` must be a multiple of `BLOCK_ROWS`. A program moves `BLOCK_ROWS` rows of
    `column_block(dim)` columns."""
    rows, dim = index.shape[0], x.shape[1]
    if rows % BLOCK_ROWS:
        raise ValueError(f"gather_rows: {rows} rows is not a multiple of BLOCK_ROWS {BLOCK_ROWS}")
    has_scale, has_dot = scale is not None, dot_with is not None
    columns = column_block(dim)

    def kernel(index_ref, x_ref, *rest):
        scale_ref = rest[0] if has_scale else None
        dot_ref = rest[int(has_scale)] if has_dot else None
        out_ref, *dots_ref = rest[int(has_scale) + int(has_dot) :]
        gathered = x_ref[index_ref[...], :]
        if has_dot:  # this program's columns' share of each row's dot product
            products = gathered.astype(jnp.float32) * dot_ref[...].astype(jnp.float32)
            dots_ref[0][...] = jnp.sum(products, axis=1, keepdims=True)
        if has_scale:
            weights = scale_ref[...].astype(jnp.float32)[:, None]
            gathered = (gathered.astype(jnp.float32) * weights).astype(out_ref.dtype)
        out_ref[...] = gathered

    row_block = pl.BlockSpec((BLOCK_ROWS,), lambda i, j: (i,))
    tile = pl.BlockSpec((BLOCK_ROWS, columns), lambda i, j: (i, j))
    source = pl.BlockSpec((x.shape[0], columns), lambda i, j: (0, j))  # every row: gathered
    operands, in_specs = [index, x], [row_block, source]
    out_shape, out_specs = [jax.ShapeDtypeStruct((rows, dim), x.dtype)], [tile]
    if has_scale:
        operands, in_specs = operands + [scale], in_specs + [row_block]
    if has_dot:
        operands, in_specs = operands + [dot_with], in_specs + [tile]
        out_shape.append(jax.ShapeDtypeStruct((rows, dim // columns), jnp.float32))
        out_specs.append(pl.BlockSpec((BLOCK_ROWS, 1), lambda i, j: (i, j)))
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(rows // BLOCK_ROWS, dim // columns),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS),
        interpret=interpret,
    )(*operands)
    return out[0] if not has_dot else (out[0], out[1].sum(axis=1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def expand_rows(
    interpret: bool,
    x: Float[Array, "tokens dim"],
    order: Int[Array, " copies"],
    inverse: Int[Array, " copies"],
) -> Float[Array, "copies dim"]:
    """`jnp_backend.expand_rows` with the forward's gather by the kernel."""
    return gather_rows(x, order // (order.shape[0] // x.shape[0]), interpret=interpret)


def _expand_fwd(interpret, x, order, inverse):
    return expand_rows(interpret, x, order, inverse), (x.shape[0], inverse)


def _expand_bwd(interpret, res, g):
    return jnp_backend._expand_bwd(res, g)


expand_rows.defvjp(_expand_fwd, _expand_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine_rows(
    interpret: bool,
    y_rows: Float[Array, "copies dim"],
    weights: Float[Array, "tokens k"],
    order: Int[Array, " copies"],
    inverse: Int[Array, " copies"],
) -> Float[Array, "tokens dim"]:
    """`jnp_backend.combine_rows` with the backward's gather and the weights' gradient in one
    kernel."""
    return jnp_backend._combine_fwd(y_rows, weights, order, inverse)[0]


def _combine_fwd(interpret, y_rows, weights, order, inverse):
    return combine_rows(interpret, y_rows, weights, order, inverse), (
        y_rows,
        weights,
        order,
        inverse,
    )


def _combine_bwd(interpret, res, dy):
    y_rows, weights, order, inverse = res
    tokens, k = weights.shape
    w_rows = weights.reshape(-1)[order]
    d_rows, row_dots = gather_rows(dy, order // k, w_rows, dot_with=y_rows, interpret=interpret)
    d_weights = row_dots[inverse].reshape(tokens, k).astype(weights.dtype)
    return d_rows.astype(y_rows.dtype), d_weights, None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)


class PallasSortDispatcher(jnp_backend.SortDispatcher):
    """`SortDispatcher` with the dispatch's row expansion by `gather_rows` (GPU; `interpret=True`
    runs the kernel's Python on any device, slowly, for tests). `fused_combine_backward=True`
    also moves the combine's backward into the kernel; off by default, as on the H200 it measured
    1.5x slower than XLA's own one-pass fusion of the same two outputs. Where `tokens * k` is not
    a multiple of `BLOCK_ROWS`, XLA's gathers as in `SortDispatcher`."""

    requires_gpu: ClassVar[bool] = True
    interpret: bool = eqx.field(default=False, static=True)
    fused_combine_backward: bool = eqx.field(default=False, static=True)

    def _expand_rows(self, x, order, inverse):
        if order.shape[0] % BLOCK_ROWS:
            return super()._expand_rows(x, order, inverse)
        return expand_rows(self.interpret, x, order, inverse)

    def _combine_rows(self, y_rows, weights, order, inverse):
        if not self.fused_combine_backward or order.shape[0] % BLOCK_ROWS:
            return super()._combine_rows(y_rows, weights, order, inverse)
        return combine_rows(self.interpret, y_rows, weights, order, inverse)
