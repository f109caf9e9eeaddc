"""The MoE's row gathers by XLA and by a Pallas kernel (Triton lowering), on a GPU.

    python experiments/bench_row_gather.py [--tokens 49152] [--dim 1024] [--k 6]
    python experiments/bench_row_gather.py --step --batch 24     # also the proxy-2b train step

Two gathers of bf16 rows run at every MoE layer: the dispatch's expansion (`x[order // k]`,
`dropless.backends.jnp.expand_rows`) and the combine's backward (`dy[order // k] * w`,
`combine_rows`). XLA writes bf16 rows at about half the bytes per second of float32 ones
(docs/benchmarks.md, fourteenth run); a Pallas kernel loads and stores whole `[rows dim]`
tiles. Prints each kernel's time (CUPTI) over XLA's, measured in the same run, and checks
that the two agree exactly. With --step, the train step (pallas backend, cuDNN attention,
unrolled layers) with the library's gathers and with these, in one process.
"""

import argparse
import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import dropless.backends.jnp as jnp_backend

BLOCK_ROWS = 32  # rows per program: a [32 1024] bf16 tile is 64 KiB,
NUM_WARPS = 8  # 256 B of it per thread (512 B as float32 when scaled)


def gather_rows(x, index, scale=None, dot_with=None, *, block_rows=BLOCK_ROWS, interpret=False):
    """`x[index]`, or `(x[index] * scale[:, None])` rounded to x's dtype, by a Pallas kernel:
    each program gathers `block_rows` rows. `len(index)` must be a multiple of `block_rows`.

    With `dot_with` ([len(index) dim]) also returns each row's float32 dot product with the
    gathered row before scaling, `<x[index[r]], dot_with[r]>`: the combine's weight gradient,
    computed while the row is loaded instead of in a second pass over both."""
    rows, dim = index.shape[0], x.shape[1]
    if rows % block_rows:
        raise ValueError(f"gather_rows: {rows} rows is not a multiple of block_rows {block_rows}")

    def kernel(index_ref, x_ref, *rest):
        scale_ref = rest[0] if scale is not None else None
        dot_ref = rest[int(scale is not None)] if dot_with is not None else None
        out_ref, *dots_ref = rest[int(scale is not None) + int(dot_with is not None) :]
        gathered = x_ref[index_ref[...], :]
        if dot_ref is not None:
            products = gathered.astype(jnp.float32) * dot_ref[...].astype(jnp.float32)
            dots_ref[0][...] = jnp.sum(products, axis=1)
        if scale_ref is not None:
            weights = scale_ref[...].astype(jnp.float32)[:, None]
            gathered = (gathered.astype(jnp.float32) * weights).astype(out_ref.dtype)
        out_ref[...] = gathered

    row_block = pl.BlockSpec((block_rows,), lambda i: (i,))
    tile = pl.BlockSpec((block_rows, dim), lambda i: (i, 0))
    operands, in_specs = [index, x], [row_block, pl.BlockSpec(x.shape, lambda i: (0, 0))]
    out_shape, out_specs = [jax.ShapeDtypeStruct((rows, dim), x.dtype)], [tile]
    if scale is not None:
        operands, in_specs = operands + [scale], in_specs + [row_block]
    if dot_with is not None:
        operands, in_specs = operands + [dot_with], in_specs + [tile]
        out_shape.append(jax.ShapeDtypeStruct((rows,), jnp.float32))
        out_specs.append(row_block)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(rows // block_rows,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS),
        interpret=interpret,
    )(*operands)
    return out[0] if dot_with is None else tuple(out)


def pallas_expand_and_combine(interpret=False, fuse_dots=False):
    """`expand_rows` and `combine_rows` as in dropless.backends.jnp (whose other halves of the
    VJPs they use), with the two row gathers by `gather_rows`: what `--step` patches in. With
    `fuse_dots`, the combine's weight gradient comes out of its backward gather as well."""
    gather = functools.partial(gather_rows, interpret=interpret)

    @jax.custom_vjp
    def expand_rows(x, order, inverse):
        return gather(x, order // (order.shape[0] // x.shape[0]))

    def expand_fwd(x, order, inverse):
        return expand_rows(x, order, inverse), (x.shape[0], inverse)

    expand_rows.defvjp(expand_fwd, jnp_backend._expand_bwd)

    @jax.custom_vjp
    def combine_rows(y_rows, weights, order, inverse):
        # the library's forward, not `jnp_backend.combine_rows`: while `pallas_gathers` is on,
        # that name is this function (calling it recursed without end)
        return jnp_backend._gather_sum(y_rows, inverse.reshape(weights.shape), weights).astype(
            y_rows.dtype
        )

    def combine_bwd(res, dy):
        y_rows, weights, order, inverse = res
        tokens, k = weights.shape
        w_rows = weights.reshape(-1)[order]
        if fuse_dots:
            d_rows, row_dots = gather(dy, order // k, w_rows, dot_with=y_rows)
            d_weights = row_dots[inverse].reshape(tokens, k)
        else:
            d_rows = gather(dy, order // k, w_rows)
            d_weights = jnp_backend._gathered_dots(y_rows, inverse.reshape(tokens, k), dy)
        d_rows = d_rows.astype(y_rows.dtype)
        return d_rows, d_weights.astype(weights.dtype), None, None

    def combine_fwd(y_rows, weights, order, inverse):
        return combine_rows(y_rows, weights, order, inverse), (y_rows, weights, order, inverse)

    combine_rows.defvjp(combine_fwd, combine_bwd)
    return expand_rows, combine_rows


def pallas_gathers(interpret=False, fuse_dots=False) -> contextlib.ExitStack:
    """A context in which dropless.backends.jnp dispatches and combines with these kernels."""
    expand_rows, combine_rows = pallas_expand_and_combine(interpret, fuse_dots)
    from bench_train import patched

    stack = contextlib.ExitStack()
    stack.enter_context(patched(jnp_backend, "expand_rows", expand_rows))
    stack.enter_context(patched(jnp_backend, "combine_rows", combine_rows))
    return stack


def kernels(tokens: int, dim: int, k: int) -> list[dict]:
    """Kernel time of each gather by XLA and by Pallas, same inputs, checked: "equal" is
    bitwise, "rel err" the largest difference over the largest value (the fused dot products
    sum in another order than XLA's)."""
    from _timing import kernel_time

    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, dim), jnp.bfloat16)
    order = jax.random.permutation(keys[1], tokens * k).astype(jnp.int32)
    w = jax.random.uniform(keys[2], (tokens * k,))
    y = jax.random.normal(keys[3], (tokens * k, dim), jnp.bfloat16)
    index = order // k
    f32 = jnp.float32

    def scaled_and_dots(x, i, w, y):
        gathered = x[i].astype(f32)
        return (gathered * w[:, None]).astype(x.dtype), jnp.sum(gathered * y.astype(f32), 1)

    cases = {
        "expand x[order // k]": (
            jax.jit(lambda x, i: x[i]),
            jax.jit(lambda x, i: gather_rows(x, i)),
            (x, index),
        ),
        "combine bwd dy[order // k] * w": (
            jax.jit(lambda x, i, w: (x[i].astype(f32) * w[:, None]).astype(x.dtype)),
            jax.jit(lambda x, i, w: gather_rows(x, i, w)),
            (x, index, w),
        ),
        "combine bwd, with <dy[order // k], y_rows>": (
            jax.jit(scaled_and_dots),
            jax.jit(lambda x, i, w, y: gather_rows(x, i, w, dot_with=y)),
            (x, index, w, y),
        ),
    }
    rows = []
    for name, (by_xla, by_pallas, args) in cases.items():
        row = {"gather": name}
        try:
            want, got = jax.tree.leaves(by_xla(*args)), jax.tree.leaves(by_pallas(*args))
            pairs = list(zip(want, got, strict=True))
            equal = all(bool(jnp.array_equal(a, b)) for a, b in pairs)
            rel_err = max(
                float(jnp.max(jnp.abs(a.astype(f32) - b.astype(f32))) / jnp.max(jnp.abs(a)))
                for a, b in pairs
            )
            xla, pallas = kernel_time(by_xla, *args), kernel_time(by_pallas, *args)
            written = tokens * k * dim * 2
            row |= {
                "xla ms": 1e3 * xla,
                "pallas ms": 1e3 * pallas,
                "pallas / xla": pallas / xla,
                "pallas TB/s written": written / pallas / 1e12,
                "equal": equal,
                "rel err": rel_err,
            }
        except Exception as err:  # noqa: BLE001 -- a lowering this JAX lacks: report, go on
            row["error"] = f"{type(err).__name__}: {str(err)[:160]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=49152, help="proxy-2b batch 24 x 2048")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--step", action="store_true", help="also the proxy-2b train step")
    parser.add_argument("--batch", type=int, default=24, help="train-step batch (x 2048)")
    args = parser.parse_args()
    kernels(args.tokens, args.dim, args.k)
    if args.step:
        from bench_train import compare

        from dropless.models.deepseek_v3 import get_preset

        config = get_preset(
            "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
        )
        variants = {
            "XLA gathers (library)": contextlib.nullcontext,
            "Pallas gathers": pallas_gathers,
            "Pallas gathers, weight-gradient dots fused": functools.partial(
                pallas_gathers, fuse_dots=True
            ),
        }
        compare(config, "pallas", variants, batch=args.batch)


if __name__ == "__main__":
    main()
