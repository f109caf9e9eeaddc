"""CPU benchmark: grouped matmul strategies over a dense matmul of equal FLOPs.

    python benchmarks/bench_grouped_matmul.py [--out results/bench_grouped_matmul]

For experts = 8, 64, 256 and balanced or Dirichlet-skewed group sizes, times the pure-jnp default
(`ChunkedGroupedMatmul`, "jnp-chunked"), `CapacityGroupedMatmul` ("jnp-capacity") and `RaggedDot`
(`jax.lax.ragged_dot`), forward and forward+backward (gradients w.r.t. the rows and the expert
weights), and divides each by a dense matmul [rows in] @ [in out]: the grouped matmul's FLOPs in
one call, timed just before and just after each strategy. A ratio of 3 means three times slower
than dense. The targets for the default are at most 3x, 3x and 4x of dense at 8, 64 and 256
experts. Writes JSON + CSV + a PNG bar plot to --out.

The 256-expert weight gradient is a 134 MB buffer per call, which glibc page-faults in afresh at
every call unless it keeps freed memory for reuse: the script first calls
`dropless._allocator.keep_freed_memory()`, as the `dropless` command does (`--glibc-default`
leaves the allocator as it is). `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` backs large buffers
with transparent huge pages, which also makes faulting them cheaper. Both settings are recorded
in the results.
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _timing import fwd_bwd, machine, median_time, print_table, write_results

# The allocator setting and the chunk size are internals, of `_allocator` and `_chunked`.
from dropless._allocator import keep_freed_memory
from dropless.backends import CapacityGroupedMatmul, ChunkedGroupedMatmul, RaggedDot
from dropless.backends._chunked import default_chunk

TARGETS = {8: 3.0, 64: 3.0, 256: 4.0}  # jnp default time over dense, at most


def group_sizes(routing: str, experts: int, rows: int, alpha: float, seed: int) -> np.ndarray:
    if routing == "balanced":
        sizes = np.full(experts, rows // experts)
        sizes[0] += rows - sizes.sum()
        return sizes
    rng = np.random.default_rng(seed)
    return rng.multinomial(rows, rng.dirichlet(np.full(experts, alpha)))


def samples(fn, args, n: int) -> list[float]:
    return [median_time(fn, *args, repeats=1, warmup=0) for _ in range(n)]


def against_dense(fn, dense_fn, args, dense_args, *, repeats: int, budget_s: float) -> dict:
    """Median time of fn, and of its dense reference timed just before and just after it (so
    that load from other jobs on a shared machine falls on both alike). A first call of fn
    (compile + run) sizes the measurement: slow calls are timed fewer times."""
    jax.block_until_ready(dense_fn(*dense_args))  # compiles
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    n = int(max(1, min(repeats, budget_s // max(first, 1e-9))))
    t_dense = samples(dense_fn, dense_args, repeats)
    t = samples(fn, args, n)
    t_dense += samples(dense_fn, dense_args, repeats)
    t, t_dense = statistics.median(t), statistics.median(t_dense)
    return {"t": t, "dense": t_dense, "ratio": t / t_dense, "n": n}


def run(args) -> list[dict]:
    rows, width_in, width_out = args.rows, args.in_width, args.out_width
    keys = jax.random.split(jax.random.key(0), 4)
    cotangent = jax.random.normal(keys[3], (rows, width_out), jnp.float32)  # for fwd_bwd
    lhs = jax.random.normal(keys[0], (rows, width_in), jnp.float32)
    w_dense = jax.random.normal(keys[1], (width_in, width_out), jnp.float32) / width_in**0.5
    dense = lambda a, b: a @ b  # the grouped matmul's FLOPs (2 rows in out) in one call
    dense_fwd, dense_fb = jax.jit(dense), fwd_bwd(dense)
    strategies = {
        "jnp-chunked": ChunkedGroupedMatmul(chunk=args.chunk),
        "jnp-capacity": CapacityGroupedMatmul(chunk=args.chunk),
        "ragged_dot": RaggedDot(),
    }
    budget = dict(repeats=args.repeats, budget_s=args.budget)
    results = []
    for experts in args.experts:
        rhs = jax.random.normal(keys[2], (experts, width_in, width_out)) / width_in**0.5
        for routing in ("balanced", "dirichlet"):
            sizes = group_sizes(routing, experts, rows, args.alpha, seed=experts)
            gs = jnp.asarray(sizes, jnp.int32)
            outputs = {}
            for name in args.strategies:
                gmm = strategies[name]
                f = lambda a, b, gmm=gmm, gs=gs: gmm(a, b, gs)
                fwd = against_dense(jax.jit(f), dense_fwd, (lhs, rhs), (lhs, w_dense), **budget)
                fb = against_dense(
                    fwd_bwd(f), dense_fb, (lhs, rhs, cotangent), (lhs, w_dense, cotangent), **budget
                )
                outputs[name] = jax.jit(f)(lhs, rhs)
                row = {
                    "experts": experts,
                    "routing": routing,
                    "max/mean group": float(sizes.max() / sizes.mean()),
                    "strategy": name,
                    "fwd / dense": fwd["ratio"],
                    "fwd+bwd / dense": fb["ratio"],
                    "fwd ms": fwd["t"] * 1e3,
                    "fwd+bwd ms": fb["t"] * 1e3,
                    "dense fwd ms": fwd["dense"] * 1e3,
                    "dense fwd+bwd ms": fb["dense"] * 1e3,
                    "timed calls": f"{fwd['n']}/{fb['n']}",
                    "target": f"<= {TARGETS[experts]:g}x"
                    if name == "jnp-chunked" and experts in TARGETS
                    else "",
                }
                results.append(row)
            # every strategy computes the same thing: relative difference to the first one
            first = next(iter(outputs.values()))
            for r, out in zip(results[-len(outputs) :], outputs.values(), strict=True):
                r["rel. diff"] = float(jnp.linalg.norm(out - first) / jnp.linalg.norm(first))
            chunk = args.chunk or default_chunk(rows, experts)
            print_table(results[-len(outputs) :], f"{experts} experts, {routing}, chunk {chunk}")
    return results


def plot(rows: list[dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(f"{r['experts']} {r['routing'][:3]}" for r in rows))
    series = [
        (s, m) for s in dict.fromkeys(r["strategy"] for r in rows) for m in ("fwd", "fwd+bwd")
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, (s, m) in enumerate(series):
        vals = [
            next(
                (
                    r[f"{m} / dense"]
                    for r in rows
                    if r["strategy"] == s and f"{r['experts']} {r['routing'][:3]}" == lab
                ),
                np.nan,
            )
            for lab in labels
        ]
        ax.bar(np.arange(len(labels)) + i * width, vals, width, label=f"{s} {m}")
    ax.set_yscale("log")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels)
    ax.set_xlabel("experts, group sizes")
    ax.set_ylabel("time / dense matmul of equal FLOPs")
    ax.set_title(f"grouped matmul on {machine()}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench_grouped_matmul.png", dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("results/bench_grouped_matmul")
    )
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--in-width", type=int, default=256)
    parser.add_argument("--out-width", type=int, default=512)
    parser.add_argument(
        "--experts", type=lambda s: [int(e) for e in s.split(",")], default=[8, 64, 256]
    )
    parser.add_argument("--chunk", type=int, default=None, help="default: default_chunk()")
    parser.add_argument("--alpha", type=float, default=1.0, help="Dirichlet concentration")
    parser.add_argument("--strategies", default="jnp-chunked,jnp-capacity,ragged_dot")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per measurement")
    parser.add_argument(
        "--glibc-default",
        action="store_true",
        help="leave glibc's allocator as it is (default: keep_freed_memory())",
    )
    given = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(given)
    kept = False if args.glibc_default else keep_freed_memory()
    args.strategies = args.strategies.split(",")
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    env = [f"GLIBC_TUNABLES={tunables}"] if tunables else []
    meta = {
        "machine": machine(),
        "command": " ".join([*env, "python", sys.argv[0], *given]),
        "rows": args.rows,
        "in": args.in_width,
        "out": args.out_width,
        "dtype": "float32",
        "dirichlet_alpha": args.alpha,
        "chunk": args.chunk or "default_chunk(rows, experts)",
        "keep_freed_memory": kept,
    }
    print(meta)
    rows = run(args)
    write_results(args.out, "grouped_matmul", rows, meta)
    plot(rows, args.out)
    print(f"wrote {args.out}/grouped_matmul.{{json,csv}} and bench_grouped_matmul.png")
    return rows


if __name__ == "__main__":
    main()
