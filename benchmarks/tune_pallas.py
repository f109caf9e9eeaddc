"""Search tile sizes for JAX's Mosaic GPU grouped-matmul kernels, per operation and shape.

    python benchmarks/tune_pallas.py --shapes 7168x2048,2048x7168 --experts 64 --rows 512

For each forward shape [in -> out] and each of its three kernels (fwd x @ w, dgrad g @ w.T,
wgrad x.T @ g per group), checks every tile configuration of a grid for exactness on uneven and
empty groups (some are not), times the exact ones on balanced groups (kernel time from Mosaic
GPU's profiler), and prints the best beside a dense matmul of equal FLOPs timed the same way.
Ends with the entries to paste into `dropless.backends._pallas.TUNED`. Needs a Hopper GPU.
These are JAX's kernels (`PallasGroupedMatmul`'s weight gradient where our kernel's tiles do not
divide the widths); our own kernels take their tiles from
`dropless.backends.mosaic` (`config_for`, `WeightGradConfig`).
"""

import argparse
import functools
import itertools
import json
import pathlib
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
from _timing import kernel_time, machine, print_table, write_results

# Tunes the kernels' block configs, internals of the private `_pallas` module.
from dropless.backends import _pallas as pallas

GRID = {
    "block_m": (64, 128),
    "block_n": (64, 128, 256),
    "block_k": (64,),
    "max_concurrent_steps": (2, 3, 4, 6),
    "grid_block_n": (1, 2, 4, 8),
}


def kernel_ms(fn, *args) -> float:
    """Median GPU kernel time of fn(*args) in ms (CUPTI, via Mosaic GPU's profiler)."""
    return kernel_time(fn, *args) * 1e3


def operands(op, m, k, n, experts, key):
    """The operation's inputs, and the dense matmul of equal FLOPs to compare with."""
    kx, kw, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (experts, k, n), jnp.bfloat16) / k**0.5
    g = jax.random.normal(kg, (m, n), jnp.bfloat16)
    if op == "fwd":
        return (x, w), lambda: (x, w[0])
    if op == "dgrad":
        return (g, w), lambda: (g, w[0].T)
    return (x, g), lambda: (x.T, g)


def candidates(op, k, n, limit, seed=0):
    """Valid grid points for `op`, the default first, then a fixed random sample."""
    grid = [pallas.BlockConfig(*c) for c in itertools.product(*GRID.values())]
    valid = []
    for cfg in grid:
        try:
            pallas.check_divides(op, cfg, k, n)
        except ValueError:
            continue
        if op == "wgrad" and cfg.grid_block_n != 1:
            continue  # the weight-gradient kernel tiles by (block_m, block_n) only
        valid.append(cfg)
    default = pallas.BlockConfig()
    rest = [c for c in valid if c != default]
    random.Random(seed).shuffle(rest)
    return [default, *rest][:limit]


def exactness_check(op, k, n):
    """A function telling whether a tiling computes `op` exactly on uneven and empty groups
    (16 experts, 1000 rows: Dirichlet sizes with a quarter of the groups empty)."""
    rng = np.random.default_rng(k + n)
    p = rng.dirichlet(np.full(16, 0.3))
    p[:4] = 0
    sizes = jnp.asarray(rng.multinomial(1000, p / p.sum()), jnp.int32)
    (a, b), _ = operands(op, 1000, k, n, 16, jax.random.key(1))
    want = pallas.reference_op(op, a, b, sizes)

    def exact(cfg) -> bool:
        got = pallas.run_op(op, a, b, sizes, cfg).astype(jnp.float32)
        return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= 1e-2

    return exact


def tune(op, k, n, experts, rows, limit):
    m = experts * rows
    (a, b), dense_args = operands(op, m, k, n, experts, jax.random.key(0))
    sizes = jnp.full((experts,), rows, jnp.int32)
    dense_ms = kernel_ms(jnp.matmul, *dense_args())
    exact = exactness_check(op, k, n)
    results, inexact = [], 0
    for cfg in candidates(op, k, n, limit):
        fn = jax.jit(functools.partial(pallas.run_op, op, cfg=cfg))
        try:
            if not exact(cfg):  # timed on balanced groups, so checked on uneven ones first
                inexact += 1
                print(f"  {op} {k}x{n} {cfg}: inexact on uneven groups, rejected")
                continue
            results.append((kernel_ms(fn, a, b, sizes), cfg))
        except Exception as err:  # noqa: BLE001 -- e.g. tiles that exceed shared memory
            print(f"  {op} {k}x{n} {cfg}: {str(err).splitlines()[0][:100]}")
    results.sort(key=lambda r: r[0])
    default_ms = next((t for t, c in results if c == pallas.BlockConfig()), float("nan"))
    best_ms, best = results[0] if results else (float("nan"), None)
    return {
        "op": op,
        "in x out": f"{k}x{n}",
        "experts x rows": f"{experts}x{rows}",
        "timed": len(results),
        "inexact": inexact,
        "default / dense": dense_ms / default_ms,
        "best / dense": dense_ms / best_ms,
        "dense TFLOP/s": 2 * m * k * n / dense_ms / 1e9,
        "best": best,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="7168x2048,2048x7168", help="in x out widths")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--rows", type=int, default=512, help="rows per expert (balanced)")
    parser.add_argument("--ops", default="fwd,dgrad,wgrad")
    parser.add_argument("--limit", type=int, default=24, help="configurations per op and shape")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/tune_pallas"))
    parser.add_argument(
        "--tiles-out", type=pathlib.Path, help="also write the best tiles as a JSON tiles file"
    )
    args = parser.parse_args(argv)
    pallas.load_kernels()
    rows = []
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        for op in args.ops.split(","):
            start = time.perf_counter()
            rows.append(tune(op, k, n, args.experts, args.rows, args.limit))
            print_table(rows[-1:], f"{op} {shape} ({time.perf_counter() - start:.0f} s)")
    print_table(rows, f"Pallas tiles, {machine()}")
    print("\nTUNED entries:")
    entries = []
    for r in rows:
        if r["best"] is None:
            continue  # no exact tiling found: the default stays
        k, n = map(int, r["in x out"].split("x"))
        print(f'    ("{r["op"]}", {k}, {n}): {r["best"]},')
        entries.append({"op": r["op"], "in": k, "out": n, **r["best"].kwargs()})
        r["best"] = str(r["best"])
    if args.tiles_out:
        args.tiles_out.write_text(json.dumps(entries, indent=1))
        print(
            f"tiles file: {args.tiles_out} (use with "
            f"PallasGroupedMatmul(tiles=TileTable.from_file({str(args.tiles_out)!r})))"
        )
    meta = {"machine": machine(), **{k: str(v) for k, v in vars(args).items()}}
    write_results(args.out, "tune_pallas", rows, meta)


if __name__ == "__main__":
    main()
