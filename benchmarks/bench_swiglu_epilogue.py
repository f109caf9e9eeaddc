"""The experts' gate-and-up grouped matmul with the SwiGLU in its epilogue, against the same
kernel followed by XLA's SwiGLU, on a Hopper GPU (kernel time).

    python benchmarks/bench_swiglu_epilogue.py [--cases 1024x512@64x4608,7168x2048@8x2048]

A case K x HIDDEN @ EXPERTS x ROWS multiplies EXPERTS x ROWS rows of width K (balanced groups)
by [K, 2 x HIDDEN] gate-and-up weights. "separate": `mosaic.grouped_matmul` on the plain
`[gate | up]` weights, then `silu(gate) * up` by XLA (the library's path); "fused":
`mosaic.grouped_matmul_swiglu` on the interleaved weights, both outputs kept (the backward
needs the gate and up). Prints both times, fused over separate, and how far the two hidden
outputs are apart. `--interpret`: Mosaic GPU's interpreter on any device (tiny cases; for tests).
"""

import argparse
import pathlib

import jax
import jax.numpy as jnp

from dropless import swiglu
from dropless.backends import mosaic

# The kernels' interpreter switch (INTERPRET) is an internal of the private `_launch` module.
from dropless.backends.mosaic import _launch


def measure(cases: list[str], interpret: bool = False) -> list[dict]:
    from _timing import kernel_time, median_time

    # The interpreter takes seconds a call: one timed call, after the outputs' call below.
    timed = (lambda f, *a: median_time(f, *a, repeats=1, warmup=0)) if interpret else kernel_time
    config = mosaic.KernelConfig(tile_m=64, tile_n=64, band=2) if interpret else None
    rows_out = []
    for case in cases:
        widths, layout = case.split("@")
        k, hidden = map(int, widths.split("x"))
        experts, per = map(int, layout.split("x"))
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], (experts * per, k), jnp.bfloat16)
        w_gate, w_up = (
            (jax.random.normal(key, (experts, k, hidden)) / k**0.5).astype(jnp.bfloat16)
            for key in keys[1:]
        )
        sizes = jnp.full((experts,), per, jnp.int32)
        plain = jnp.concatenate([w_gate, w_up], axis=-1)
        interleaved = mosaic.interleave_gate_up(w_gate, w_up, config)

        def separate(x, w, s):
            gate_up = mosaic.grouped_matmul(x, w, s, config=config)
            return gate_up, swiglu(gate_up)

        def fused(x, w, s):
            return mosaic.grouped_matmul_swiglu(x, w, s, config=config)

        separate, fused = jax.jit(separate), jax.jit(fused)
        h_separate = separate(x, plain, sizes)[1].astype(jnp.float32)
        h_fused = fused(x, interleaved, sizes)[1].astype(jnp.float32)
        t_separate = timed(separate, x, plain, sizes)
        t_fused = timed(fused, x, interleaved, sizes)
        rows_out.append(
            {
                "case": case,
                "separate ms": 1e3 * t_separate,
                "fused ms": 1e3 * t_fused,
                "fused / separate": t_fused / t_separate,
                "rel diff": float(jnp.abs(h_fused - h_separate).max() / jnp.abs(h_separate).max()),
            }
        )
    return rows_out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # DeepSeek-V3's widths with 8 experts: with 256, each of the four weight tensors held here is
    # 14 GiB, and the fused call ran out of an H100's memory
    p.add_argument("--cases", default="1024x512@64x4608,7168x2048@8x2048")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    args = p.parse_args(argv)
    from _timing import machine, print_table, write_results

    if args.interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        _launch.INTERPRET = InterpretGPUParams()
    rows = measure(args.cases.split(","), args.interpret)
    print_table(rows, f"gate-and-up grouped matmul with its SwiGLU, {machine()}")
    write_results(args.out, "swiglu_epilogue", rows, {"machine": machine()})
    return rows


if __name__ == "__main__":
    main()
