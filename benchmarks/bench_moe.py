"""GPU benchmark: grouped GEMM strategies and the MoE layer against dense references.

    python benchmarks/bench_moe.py [--out results/bench_moe] [--quick]
    python benchmarks/bench_moe.py --replot benchmarks/results/grouped_gemm_h200.json --out docs/img

Every ratio is against a dense reference timed in the same run: grouped GEMM throughput over a
dense matmul of equal FLOPs (>1 is faster than dense), and MoE layer time over a dense SwiGLU of
the same active FLOPs (<1 is faster than dense). The grouped GEMM's reference and strategies are
timed in interleaved rounds (--rounds): each ratio is of medians over the rounds, and "fwd+bwd
spread" is (slowest - fastest) / median of a strategy's rounds. Strategies that do not load or run
out of memory are reported as such. Writes JSON + CSV + PNG to --out.
"""

import argparse
import contextlib
import csv
import json
import pathlib
import statistics

import _profile
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import fwd_bwd, machine, median_time, print_table, write_results

from dropless import MoE, RoutingSpec, SwiGLU
from dropless.backends import (
    BackendUnavailableError,
    CapacityGroupedMatmul,
    ChunkedGroupedMatmul,
    RaggedDot,
    with_backend,
)
from dropless.train import get_backend


def gmm_strategies():
    out = {
        "jnp-chunked": ChunkedGroupedMatmul(),
        "jnp-capacity": CapacityGroupedMatmul(),
        "ragged_dot": RaggedDot(),
    }
    try:
        # The kernels' loaders and paths are internals of the private backend modules.
        from dropless.backends import _te as te

        te.load_te()
        out["te"] = te.TEGroupedMatmul()
        print("TE grouped GEMM path:", te.grouped_gemm_path())
    except BackendUnavailableError as err:
        print("TE unavailable:", err)
    try:
        from dropless.backends import _pallas as pallas

        pallas.load_kernels()
        out["pallas"] = pallas.PallasGroupedMatmul()
    except BackendUnavailableError as err:
        print("Pallas unavailable:", err)
    try:
        from dropless.backends import _tokamax as tokamax

        tokamax.load_tokamax()
        out["tokamax"] = tokamax.TokamaxGroupedMatmul()
    except BackendUnavailableError as err:
        print("tokamax unavailable:", err)
    return out


def sizes_for(routing, e, rows, rng):
    if routing == "balanced":
        return np.full(e, rows // e)
    return rng.multinomial(rows, rng.dirichlet(np.ones(e)))


def time_or_status(fn, *args):
    try:
        return median_time(fn, *args)
    except Exception as err:  # noqa: BLE001 -- report OOM / unsupported and go on
        text = str(err)
        return (
            "OOM"
            if "RESOURCE_EXHAUSTED" in text or "out of memory" in text
            else f"error: {text[:80]}"
        )


SHAPES = "8x2048,64x512,256x256,256x128"  # experts x rows per expert


def bench_gmm(strategies, quick, tiny=False, rounds=3, shapes=SHAPES):
    rows_out = []
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in shapes.split(",")]
    widths = [(7168, 2048), (2048, 7168)]
    if tiny:  # a CPU smoke run of the script itself
        shapes, widths = [(8, 64), (64, 16)], [(128, 64), (64, 128)]
    for (e, per_expert), (k, n), routing in (
        (s, w, r) for s in shapes for w in widths for r in ("balanced", "dirichlet")
    ):
        if quick and (k, n) != widths[0]:
            continue
        m = e * per_expert
        keys = jax.random.split(jax.random.key(e + k), 3)
        lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        rhs = (jax.random.normal(keys[1], (e, k, n)) / k**0.5).astype(jnp.bfloat16)
        gs = jnp.asarray(sizes_for(routing, e, m, rng), jnp.int32)

        cotangent = jax.random.normal(keys[2], (m, n), jnp.bfloat16)  # for fwd_bwd

        # The same FLOPs in one matmul, on its own [K N] weight (differentiating b[0] of the
        # expert stack would also write a zero gradient for every other expert).
        dense = lambda a, b: a @ b  # noqa: E731
        timed = {"dense": (jax.jit(dense), fwd_bwd(dense), (lhs, rhs[0]))}
        skipped = {}
        for name, gmm in strategies.items():
            if name in ("ragged_dot", "jnp-chunked") and e > 8 and not tiny:
                skipped[name] = "skipped (slow; see the 8-expert rows)"
                continue
            f = lambda a, b, gmm=gmm, gs=gs: gmm(a, b, gs)  # noqa: E731
            timed[name] = (jax.jit(f), fwd_bwd(f), (lhs, rhs))
        # Rounds of every function in turn: a slow spell of the GPU (clocks, a neighbour)
        # then lands on the dense reference and the strategies alike, not on one of them.
        times = {name: ([], []) for name in timed}
        for _ in range(rounds):
            for name, (fwd, fb, args) in timed.items():
                times[name][0].append(time_or_status(fwd, *args))
                times[name][1].append(time_or_status(fb, *args, cotangent))
        t_dense, t_dense_fb = (statistics.median(t) for t in times.pop("dense"))
        flops = 2 * m * k * n
        for name in strategies:
            fwd, bwd = (skipped[name],) * 2 if name in skipped else map(_summary, times[name])
            rows_out.append(
                {
                    "experts": e,
                    "rows/expert": per_expert,
                    "K x N": f"{k}x{n}",
                    "routing": routing,
                    "strategy": name,
                    "fwd TFLOP/s": flops / fwd / 1e12 if isinstance(fwd, float) else fwd,
                    "fwd / dense": t_dense / fwd if isinstance(fwd, float) else fwd,
                    "fwd+bwd / dense": t_dense_fb / bwd if isinstance(bwd, float) else bwd,
                    "fwd+bwd spread": _spread(times[name][1]) if name in times else "",
                    "dense TFLOP/s": flops / t_dense / 1e12,
                }
            )
        print_table(rows_out[-len(strategies) :])
    return rows_out


def _summary(times: list):
    """The median of a strategy's round times, or its status (OOM, error) if any round had one."""
    status = next((t for t in times if not isinstance(t, float)), None)
    return status if status is not None else statistics.median(times)


def _spread(times: list) -> float | str:
    """(slowest - fastest) / median over the rounds."""
    if not all(isinstance(t, float) for t in times):
        return ""
    return (max(times) - min(times)) / statistics.median(times)


LAYER_BACKENDS = "jnp,jnp-capacity,te,te-gmm,pallas,tokamax,ragged"


def profile_layer(step, layer, x, name, out):
    """Prints (and writes) the device time per scope of one layer step."""
    hlo = step.lower(layer, x).compile().compiled.as_text()
    scopes, kernels = _profile.profile(lambda: jax.block_until_ready(step(layer, x)), hlo)
    print_table(scopes, f"{name}: device time per scope")
    print_table(kernels[:12], f"{name}: top kernels")
    write_results(out, f"profile_layer_{name}", scopes + kernels, {"backend": name})


def bench_layer(
    quick,
    tiny=False,
    token_counts=(8192, 16384, 32768),
    layer_backends=None,
    experts=256,
    profile_to=None,
):
    layer_backends = layer_backends or LAYER_BACKENDS.split(",")
    dim, hidden, experts, k = (128, 32, 16, 4) if tiny else (7168, 2048, experts, 8)
    spec = RoutingSpec(
        experts,
        k,
        "sigmoid",
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        use_expert_bias=True,
    )
    moe = MoE(dim, hidden, spec, n_shared_experts=1, dtype=jnp.bfloat16, key=jax.random.key(0))
    dense = SwiGLU(dim, hidden * (k + 1), dtype=jnp.bfloat16, key=jax.random.key(1))
    names = layer_backends
    rows = []
    for tokens in [256] if tiny else [8192] if quick else token_counts:
        x = jax.random.normal(jax.random.key(2), (tokens, dim), jnp.bfloat16)

        @eqx.filter_jit
        def step(layer, x):
            def loss(layer_and_x):
                layer, x = layer_and_x
                y = layer(x)
                y = y[0] if isinstance(y, tuple) else y
                return jnp.sum(y.astype(jnp.float32))

            # w.r.t. the weights and the input, as for any layer inside a network
            return eqx.filter_grad(loss)((layer, x))

        t_dense = median_time(step, dense, x, repeats=5)
        active_flops = 3 * 2 * tokens * 3 * dim * hidden * (k + 1)  # fwd + bwd = 3x fwd
        row = {
            "tokens": tokens,
            "dense ms": t_dense * 1e3,
            "dense TFLOP/s": active_flops / t_dense / 1e12,
        }
        for name in names:
            if name == "ragged" and tokens * experts > 8192 * 256 and not tiny:
                row[f"{name} / dense"] = "skipped"
                continue
            try:
                layer = with_backend(moe, get_backend(name))
            except BackendUnavailableError:
                row[f"{name} / dense"] = "unavailable"
                continue
            t = time_or_status(step, layer, x)
            row[f"{name} / dense"] = t / t_dense if isinstance(t, float) else t
            if profile_to is not None and isinstance(t, float):
                profile_layer(step, layer, x, f"{name}_{tokens}", profile_to)
        rows.append(row)
        title = f"MoE layer fwd+bwd, {tokens} tokens, {experts} experts (time over dense SwiGLU)"
        print_table(rows[-1:], title)
    return rows


# The targets for the best GPU strategy, fwd+bwd throughput over dense, by rows per expert
TARGETS = {2048: 0.90, 512: 0.80, 256: 0.70}  # none set at 128 rows per expert


def _label(row) -> str:
    return f"{row['experts']}x{row['rows/expert']} {row['K x N']} {row['routing'][:3]}"


def plot(rows, out, name="bench_moe_gmm.png"):
    """Bars of fwd+bwd throughput over dense per shape and strategy, each shape's target as a
    short black line (where a target is set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    labels = list(dict.fromkeys(_label(r) for r in rows))
    ratio = {(r["strategy"], _label(r)): r["fwd+bwd / dense"] for r in rows}
    width = 0.8 / len(strategies)
    for i, s in enumerate(strategies):
        vals = [ratio.get((s, lab), 0) for lab in labels]
        vals = [v if isinstance(v, float) else 0 for v in vals]  # "OOM" and the like
        ax.bar(np.arange(len(labels)) + i * width, vals, width, label=s)
    per_expert = {_label(r): int(r["rows/expert"]) for r in rows}
    first = True
    for x, lab in enumerate(labels):
        if per_expert[lab] in TARGETS:  # a line across the shape's bars
            left, right = x - width / 2, x + (len(strategies) - 0.5) * width
            label = "target" if first else None
            ax.hlines(TARGETS[per_expert[lab]], left, right, color="k", lw=1.5, label=label)
            first = False
    ax.axhline(1.0, color="k", lw=0.5, ls=":")
    centre = (len(strategies) - 1) * width / 2
    ax.set_xticks(np.arange(len(labels)) + centre, labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("fwd+bwd throughput / dense matmul")
    ax.legend(fontsize=7, ncols=len(strategies) + 1, loc="lower center", bbox_to_anchor=(0.5, 1))
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / name, dpi=120)
    plt.close(fig)


def read_rows(path: pathlib.Path) -> list[dict]:
    """The grouped-GEMM rows of a `grouped_matmul.csv` or `.json` this script wrote (or a file of
    benchmarks/results/ in the same format), numbers as floats."""
    if path.suffix == ".json":
        rows = json.loads(path.read_text())["rows"]
    else:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    needed = {"experts", "rows/expert", "K x N", "routing", "strategy", "fwd+bwd / dense"}
    missing = needed - set(rows[0] if rows else ())
    if missing:
        raise ValueError(
            f"{path}: not a grouped_matmul table of bench_moe.py: no {sorted(missing)}"
        )
    for r in rows:
        with contextlib.suppress(ValueError):  # a status such as "OOM" stays a string
            r["fwd+bwd / dense"] = float(r["fwd+bwd / dense"])
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/bench_moe"))
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--tiny", action="store_true", help="toy shapes: a CPU smoke run")
    parser.add_argument("--strategies", default="", help="comma-separated subset of strategies")
    parser.add_argument(
        "--shapes", default=SHAPES, help="grouped GEMM: experts x rows per expert, comma-separated"
    )
    parser.add_argument("--tokens", default="8192,16384,32768", help="MoE layer token counts")
    parser.add_argument("--layer-backends", default=LAYER_BACKENDS, help="MoE layer backends")
    parser.add_argument("--experts", type=int, default=256, help="MoE layer routed experts")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="MoE layer: time per scope (kernels inside CUDA command buffers land in 'other'; "
        "XLA_FLAGS=--xla_gpu_enable_command_buffer= turns those off)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="grouped GEMM: interleaved timing rounds"
    )
    parser.add_argument("--skip-gmm", action="store_true")
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument(
        "--replot",
        type=pathlib.Path,
        help="only redraw the grouped-GEMM figure from a table of an earlier run (CSV or JSON)",
    )
    args = parser.parse_args(argv)
    if args.replot:
        name = f"{args.replot.stem}.png"
        plot(read_rows(args.replot), args.out, name)
        print(f"wrote {args.out / name}")
        return
    strategies = gmm_strategies()  # loads TE before JAX starts its GPU backend (cuDNN order)
    if args.strategies:
        strategies = {k: v for k, v in strategies.items() if k in args.strategies.split(",")}
    meta = {"machine": machine(), "command": "python benchmarks/bench_moe.py"}
    print(meta["machine"])
    if not args.skip_gmm:
        gmm_rows = bench_gmm(strategies, args.quick, args.tiny, args.rounds, args.shapes)
        write_results(args.out, "grouped_matmul", gmm_rows, meta)
        plot(gmm_rows, args.out)
    if not args.skip_layer:
        tokens = [int(t) for t in args.tokens.split(",")]
        backends = args.layer_backends.split(",")
        profile_to = args.out if args.profile else None
        layer_rows = bench_layer(args.quick, args.tiny, tokens, backends, args.experts, profile_to)
        write_results(args.out, f"moe_layer_{args.experts}", layer_rows, meta)


if __name__ == "__main__":
    main()
