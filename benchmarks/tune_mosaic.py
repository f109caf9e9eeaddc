"""Search tile settings for our Mosaic GPU grouped-matmul kernels (`dropless.backends.mosaic`).

    python benchmarks/tune_mosaic.py [--cases 7168x2048@8x2048,...|proxy] [--ops fwd,dgrad,wgrad]

For each forward shape [K -> N], each layout (experts x mean rows per expert) and each routing
(balanced, Dirichlet(1)), times every candidate setting of the three kernels (fwd `x @ w`,
dgrad `g @ w.T`, wgrad `x.T @ g` per group) against a dense matmul of equal FLOPs timed in the
same run (ratio > 1: faster than dense). Each candidate is first checked against
`pallas.reference_op` on uneven groups with empty ones; an inexact candidate is reported and
not timed. Ends with the best candidate per (op, K, N, rows per expert), by the mean of its
ratios over the routings, beside the default's. Needs a Hopper GPU. Writes JSON + CSV to --out.
"""

import argparse
import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from _timing import kernel_time, machine, median_time, print_table, write_results

# Candidates are checked against `_pallas.reference_op`, an internal of the private module.
from dropless.backends import _pallas as pallas
from dropless.backends import mosaic

KC, WC = mosaic.KernelConfig, mosaic.WeightGradConfig
ROW_CANDIDATES = {  # fwd and dgrad: rows x (2 x columns) per thread block, stages, band
    "128x2x128 s3 b4": KC(),
    "128x2x128 s3 b8": KC(band=8),
    "128x2x128 s3 b16": KC(band=16),
    "128x2x64 s4 b8": KC(tile_n=64, max_concurrent_steps=4, band=8),
    "128x2x64 s4 b16": KC(tile_n=64, max_concurrent_steps=4, band=16),
    "chain 128x2x128 s2 b4": KC(max_concurrent_steps=2, chain=True),
    "chain 128x2x128 s2 b8": KC(max_concurrent_steps=2, band=8, chain=True),
    "chain 128x2x64 s4 b8": KC(tile_n=64, max_concurrent_steps=4, band=8, chain=True),
    "chain 128x2x64 s4 b16": KC(tile_n=64, max_concurrent_steps=4, band=16, chain=True),
    # Contractions of 32 columns leave shared memory for four stages of 2 x 128 columns, which
    # divide the steps of every width here, so the pipelines can chain; 64-row blocks likewise.
    # For the proxy's short contractions (512 and 1024: 8 and 16 steps of 64), where a
    # pipeline's fill and drain weigh most. Exact in Mosaic GPU's interpreter (fwd).
    "128x2x128 k32 s4 b4": KC(tile_k=32, max_concurrent_steps=4),
    "chain 128x2x128 k32 s4 b4": KC(tile_k=32, max_concurrent_steps=4, chain=True),
    "chain 128x2x128 k32 s4 b8": KC(tile_k=32, max_concurrent_steps=4, band=8, chain=True),
    "chain 64x2x128 s4 b4": KC(tile_m=64, max_concurrent_steps=4, chain=True),
}
WGRAD_CANDIDATES = {  # (2 x rows) x columns of the weight per thread block, rows per chunk
    "2x128x128 k64 s3 b16": WC(),
    "2x128x128 k64 s3 b8": WC(band=8),
    "2x128x128 k64 s2 b16": WC(max_concurrent_steps=2),
    "2x128x128 k64 s3 b32": WC(band=32),
    # one pipeline per run of experts (about this many 64-row chunks each), not per expert
    "seg16 2x128x128 k64 s3 b16": WC(segment_steps=16),
    "seg32 2x128x128 k64 s3 b16": WC(segment_steps=32),
    "seg64 2x128x128 k64 s3 b16": WC(segment_steps=64),
    "seg128 2x128x128 k64 s3 b16": WC(segment_steps=128),
    "seg64 2x128x128 k64 s3 b8": WC(segment_steps=64, band=8),
}
# DeepSeek-V3's expert widths at bench_moe.py's layouts and the proxy-2b preset's (64 experts,
# top-6 of 16,384 tokens: 1536 rows per expert; of batch 24's 49,152: 4608), most wanted first
# (see --budget). The proxy's gate and up run as one [1024 -> 1024] matmul since the fifteenth
# run; the [1024 -> 512] cases are the single matmuls of before.
CASES = ",".join(
    [f"{w}@{e}" for e in ("8x2048", "256x256") for w in ("7168x2048", "2048x7168")]
    + ["1024x512@64x1536", "512x1024@64x1536", "7168x2048@64x512", "2048x7168@64x512"]
)
PROXY_CASES = "1024x1024@64x4608,512x1024@64x4608"
DEFAULTS = {"fwd": "128x2x128 s3 b4", "dgrad": "128x2x128 s3 b4", "wgrad": "2x128x128 k64 s3 b16"}


def default_name(op: str, experts: int, rows_per_expert: int) -> str:
    """The candidate the library runs by default for `op` at this layout."""
    if op == "wgrad":
        config = mosaic.weight_grad_config_for(experts * rows_per_expert, experts)
        named = [name for name, c in WGRAD_CANDIDATES.items() if c == config]
        return named[0] if named else DEFAULTS[op]
    return DEFAULTS[op]


def applies(op: str, config, k: int, n: int) -> bool:
    """Whether a candidate can run `op` of a forward [K -> N] (tiles, stages, chain)."""
    if op == "wgrad":
        return mosaic.weight_grad_fits(k, n, config)
    return mosaic.matmul_fits(*((k, n) if op == "fwd" else (n, k)), config)


def kernel(op: str, config):
    if op == "wgrad":
        return lambda a, b, s: mosaic.grouped_weight_grad(a, b, s, config=config)
    t = op == "dgrad"
    return lambda a, b, s: mosaic.grouped_matmul(a, b, s, transpose_rhs=t, config=config)


def operands(op: str, x, w, g):
    return {"fwd": (x, w), "dgrad": (g, w), "wgrad": (x, g)}[op]


def is_exact(op: str, config, k: int = 512, n: int = 1024) -> float:
    """Relative error against the float32 reference on uneven groups, empty ones included
    (at widths every candidate divides: the settings, not the widths, decide exactness)."""
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(900, rng.dirichlet(np.ones(12)))
    sizes[[2, 7]] = 0
    sizes[0] += 900 - sizes.sum()  # every row in a group: the reference gives stray rows to one
    gs = jnp.asarray(sizes, jnp.int32)
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (900, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (12, k, n)) / k**0.5).astype(jnp.bfloat16)
    g = jax.random.normal(keys[2], (900, n), jnp.bfloat16)
    a, b = operands(op, x, w, g)
    got = jax.jit(kernel(op, config))(a, b, gs).astype(jnp.float32)
    want = pallas.reference_op(op, a, b, gs)
    return float(jnp.abs(got - want).max() / jnp.abs(want).max())


def check(op: str, name: str, config) -> float:
    """`is_exact`, reported; inf for a setting Mosaic rejects."""
    try:
        err = is_exact(op, config)
    except Exception as exc:  # noqa: BLE001 -- e.g. a layout Mosaic cannot lower
        print(f"FAILED {op} {name}: {str(exc).splitlines()[0][:160]}", flush=True)
        return float("inf")
    if not err < 1e-2:
        print(f"INEXACT {op} {name}: rel err {err:.2e}", flush=True)
    return err


def wanted(name: str, patterns: str) -> bool:
    return not patterns or any(p in name for p in patterns.split("|"))


def wall_time(fn, *args) -> float:
    return median_time(fn, *args, repeats=5)


def dense(op: str):
    """The dense matmul of equal FLOPs, on the operands of `op`."""
    return {
        "fwd": lambda a, b: a @ b[0],
        "dgrad": lambda a, b: a @ b[0].T,
        "wgrad": lambda a, b: a.T @ b,
    }[op]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        default=CASES,
        help="comma-separated KxN@EXPERTSxROWS (rows per expert), or 'proxy' for proxy-2b's "
        f"batch-24 shapes ({PROXY_CASES})",
    )
    parser.add_argument("--ops", default="fwd,dgrad,wgrad")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per case")
    parser.add_argument("--timer", choices=["kernel", "wall"], default="kernel")
    parser.add_argument("--candidates", default="", help="'|'-separated name parts to keep")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds; stops after a case")
    parser.add_argument("--out", default="results/tune_mosaic")
    args = parser.parse_args(argv)
    start = time.time()
    print(machine(), flush=True)
    ops = args.ops.split(",")
    cases = [
        tuple(int(v) for part in case.split("@") for v in part.split("x"))
        for case in (PROXY_CASES if args.cases == "proxy" else args.cases).split(",")
    ]
    timer = kernel_time if args.timer == "kernel" else wall_time
    checked: dict[tuple[str, str], float] = {}  # relative error of each (op, candidate)
    rows = []
    for k, n, e, per in cases:
        if time.time() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent: stopping before {k}x{n} {e}x{per}")
            break
        m = e * per
        rng = np.random.default_rng(e)
        keys = jax.random.split(jax.random.key(k + n + e), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (e, k, n)) / k**0.5).astype(jnp.bfloat16)
        g = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
        for routing in ("balanced", "dirichlet"):
            sizes = (
                np.full(e, per)
                if routing == "balanced"
                else rng.multinomial(m, rng.dirichlet(np.ones(e)))
            )
            gs = jnp.asarray(sizes, jnp.int32)
            for op in ops:
                a, b = operands(op, x, w, g)
                timed = {"dense": jax.jit(dense(op))}
                candidates = WGRAD_CANDIDATES if op == "wgrad" else ROW_CANDIDATES
                for name, config in candidates.items():
                    if not applies(op, config, k, n) or not wanted(name, args.candidates):
                        continue
                    if (op, name) not in checked:
                        checked[op, name] = check(op, name, config)
                    if checked[op, name] < 1e-2:
                        timed[name] = jax.jit(kernel(op, config))
                # Interleaved repeats: a slow spell of the GPU hits every candidate alike.
                times = {name: [] for name in timed}
                for _ in range(args.repeats):
                    for name, fn in timed.items():
                        times[name].append(
                            timer(fn, a, b) if name == "dense" else timer(fn, a, b, gs)
                        )
                t_dense = float(np.median(times.pop("dense")))
                for name, ts in times.items():
                    t = float(np.median(ts))
                    rows.append(
                        {
                            "op": op,
                            "K x N": f"{k}x{n}",
                            "experts x rows": f"{e}x{per}",
                            "routing": routing,
                            "candidate": name,
                            "kernel / dense": t_dense / t,
                            "kernel ms": t * 1e3,
                            "spread": (max(ts) - min(ts)) / t,
                            "dense TFLOP/s": 2 * m * k * n / t_dense / 1e12,
                        }
                    )
                    print(
                        f"{op:5s} {k}x{n} {e}x{per} {routing:9s} {name:24s} "
                        f"{t_dense / t:.3f}  ({t * 1e3:.3f} ms, spread {rows[-1]['spread']:.0%})",
                        flush=True,
                    )
    best = summarise(rows)
    print_table(best, "Best candidate per (op, K x N, experts x rows), mean over routings")
    write_results(pathlib.Path(args.out), "tune_mosaic", rows, {"machine": machine()})
    write_results(pathlib.Path(args.out), "tune_mosaic_best", best, {"machine": machine()})


def summarise(rows: list[dict]) -> list[dict]:
    by_case: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        case = (r["op"], r["K x N"], r["experts x rows"])
        by_case.setdefault(case, {}).setdefault(r["candidate"], []).append(r["kernel / dense"])
    out = []
    for (op, shape, layout), results in by_case.items():
        means = {name: float(np.mean(v)) for name, v in results.items()}
        name = max(means, key=means.get)
        out.append(
            {
                "op": op,
                "K x N": shape,
                "experts x rows": layout,
                "best": name,
                "best / dense": means[name],
                "default / dense": means.get(
                    default_name(op, *map(int, layout.split("x"))), float("nan")
                ),
                "config": dataclasses.asdict(
                    (WGRAD_CANDIDATES if op == "wgrad" else ROW_CANDIDATES)[name]
                ),
            }
        )
    return out


if __name__ == "__main__":
    main()
