"""CPU benchmark: sort dispatch + combine against the one-hot einsum dispatch of GShard/Switch.

    python benchmarks/bench_dispatch.py [--out results/bench_dispatch]

Both sides move the same tokens to experts and back, with identity experts behind an optimisation
barrier (so XLA cannot fold dispatch into combine), and are timed forward + backward (gradients
w.r.t. the tokens and the routing weights):

- sort: `SortDispatcher` (the default: a stable argsort of the tokens * k copies, gathers both
  ways), dropless;
- one-hot: the classic dispatch tensor [tokens experts capacity] at capacity factor 1.25, built
  from cumulative positions (first choices first, as in GShard) and applied with two einsums;
  copies past an expert's capacity are dropped (the column "one-hot dropped" says how many).

The target: sort at least 100x faster at 4096 tokens. Writes JSON + CSV + a PNG to --out.
"""

import argparse
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from _timing import machine, median_time, print_table, write_results

from dropless import JnpTopK, Routing, RoutingSpec
from dropless.backends import SortDispatcher


def one_hot_masks(expert_ids, weights, n_experts: int, capacity: int):
    """GShard's dispatch mask and combine weights, both [tokens experts capacity]."""
    tokens, k = expert_ids.shape
    mask = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.int32)  # [tokens k experts]
    # position of each copy in its expert's buffer: first choices of every token come first
    by_choice = mask.transpose(1, 0, 2).reshape(k * tokens, n_experts)
    position = (jnp.cumsum(by_choice, axis=0) - 1).reshape(k, tokens, n_experts)
    position = jnp.sum(position.transpose(1, 0, 2) * mask, axis=-1)  # [tokens k]
    kept = (position < capacity).astype(weights.dtype)
    slot = jax.nn.one_hot(position, capacity, dtype=weights.dtype)  # 0 past capacity
    expert = mask.astype(weights.dtype)
    dispatch = jnp.einsum("tke,tkc->tec", expert, slot)
    combine = jnp.einsum("tke,tkc,tk->tec", expert, slot, weights)
    return dispatch, combine, 1.0 - kept.mean()


def one_hot_layer(x, weights, routing: Routing, capacity: int):
    dispatch, combine, _ = one_hot_masks(
        routing.expert_ids, weights, routing.scores.shape[-1], capacity
    )
    rows = jnp.einsum("tec,td->ecd", dispatch, x)  # [experts capacity dim]
    return jnp.einsum("tec,ecd->td", combine, jax.lax.optimization_barrier(rows))


def sort_layer(x, weights, routing: Routing, capacity: int):
    del capacity  # dropless: every copy gets a row
    routing = Routing(routing.expert_ids, weights, routing.scores, routing.logits)
    dispatcher = SortDispatcher()
    dispatched = dispatcher.dispatch(x, routing)
    return dispatcher.combine(jax.lax.optimization_barrier(dispatched.rows), dispatched, routing)


def fwd_bwd(layer, capacity: int):
    """Gradients of sum(layer(x, weights) * probe) w.r.t. the tokens and the routing weights."""

    def loss(x, weights, routing, probe):
        return jnp.sum(layer(x, weights, routing, capacity) * probe)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def timed(fn, *args, repeats: int, budget_s: float) -> tuple[float, int]:
    """Median time and the number of timed calls; a first call (compile + run) sizes the
    measurement, so that slow calls are timed fewer times."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    n = int(max(1, min(repeats, budget_s // max(first, 1e-9))))
    return median_time(fn, *args, repeats=n, warmup=1 if n > 1 else 0), n


def run(args) -> list[dict]:
    spec = RoutingSpec(args.experts, args.k, "softmax")
    results = []
    for tokens in args.tokens:
        keys = jax.random.split(jax.random.key(tokens), 3)
        x = jax.random.normal(keys[0], (tokens, args.dim), jnp.float32)
        probe = jax.random.normal(keys[1], (tokens, args.dim), jnp.float32)
        logits = jax.random.normal(keys[2], (tokens, args.experts), jnp.float32)
        routing = JnpTopK()(logits, None, spec)
        capacity = math.ceil(args.capacity_factor * tokens * args.k / args.experts)
        budget = dict(repeats=args.repeats, budget_s=args.budget)

        args_ = (x, routing.weights, routing, probe)
        t_sort, n_sort = timed(fwd_bwd(sort_layer, capacity), *args_, **budget)
        row = {"tokens": tokens, "sort ms": t_sort * 1e3}
        if tokens <= args.one_hot_max_tokens:
            t_onehot, n_onehot = timed(fwd_bwd(one_hot_layer, capacity), *args_, **budget)
            dropped = one_hot_masks(routing.expert_ids, routing.weights, args.experts, capacity)[2]
            row |= {
                "one-hot ms": t_onehot * 1e3,
                "one-hot / sort": t_onehot / t_sort,
                "capacity": capacity,
                "one-hot dropped": f"{float(dropped):.2%}",
                "timed calls": f"{n_sort}/{n_onehot}",
            }
        else:
            row |= {"one-hot ms": "skipped", "capacity": capacity, "timed calls": f"{n_sort}/0"}
        results.append(row)
        print_table(results[-1:])
    return results


def plot(rows: list[dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(tokens, [r["sort ms"] for r in rows], "o-", label="sort (SortDispatcher)")
    measured = [r for r in rows if isinstance(r["one-hot ms"], float)]
    ax.plot(
        [r["tokens"] for r in measured],
        [r["one-hot ms"] for r in measured],
        "s-",
        label="one-hot einsum, capacity 1.25",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("dispatch + combine, fwd + bwd (ms)")
    ax.set_title(f"{machine()}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench_dispatch.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/bench_dispatch"))
    parser.add_argument(
        "--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[1024, 2048, 4096, 8192]
    )
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--one-hot-max-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per measurement")
    args = parser.parse_args()
    meta = {
        "machine": machine(),
        "command": " ".join(["python", *sys.argv]),
        "experts": args.experts,
        "k": args.k,
        "dim": args.dim,
        "capacity_factor": args.capacity_factor,
        "dtype": "float32",
    }
    print(meta)
    rows = run(args)
    write_results(args.out, "dispatch", rows, meta)
    plot(rows, args.out)
    print(f"wrote {args.out}/dispatch.{{json,csv}} and bench_dispatch.png")


if __name__ == "__main__":
    main()
