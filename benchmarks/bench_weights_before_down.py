"""An MoE layer's forward + backward with the routing weights applied to the expert outputs (the
default) and to the hidden units before the down projection (`MoE(weights_before_down=True)`):
what JAX keeps from the forward for the backward, XLA's temporary memory for the compiled
gradient (its own scheduling: on the CPU it can go either way), and the time, on whatever
device JAX has.

    python benchmarks/bench_weights_before_down.py [--tokens 16384 --dim 1024 --hidden 512
        --experts 64 --k 6 --backend auto --dtype bfloat16]

The defaults are proxy-2b's MoE layer at 8 sequences of 2048 tokens. Prints both settings,
and the second over the first.
"""

import argparse
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp

from dropless import MoE, RoutingSpec
from dropless.backends import with_backend
from dropless.train import get_backend


def measure(args) -> list[dict]:
    from _timing import median_time

    spec = RoutingSpec(args.experts, args.k, "sigmoid", routed_scaling_factor=2.5)
    dtype = jnp.dtype(args.dtype)
    x = jax.random.normal(jax.random.key(1), (args.tokens, args.dim), dtype)
    probe = jax.random.normal(jax.random.key(2), (args.tokens, args.dim), jnp.float32)
    rows = []
    for before in (False, True):
        moe = MoE(
            args.dim,
            args.hidden,
            spec,
            dtype=dtype,
            weights_before_down=before,
            key=jax.random.key(0),
        )
        moe = with_backend(moe, get_backend(args.backend))
        params, static = eqx.partition(moe, eqx.is_array)

        def layer(params, x, static=static):
            return eqx.combine(params, static)(x)[0]

        def loss(params, x, static=static):
            return jnp.sum(layer(params, x, static).astype(jnp.float32) * probe)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
        memory = step.lower(params, x, static).compile().memory_analysis()
        rows.append(
            {
                "weights": "before the down projection" if before else "on the outputs",
                "kept MiB": kept_for_backward(layer, params, x) / 2**20,
                "XLA temp MiB": memory.temp_size_in_bytes / 2**20,
                "fwd+bwd ms": 1e3 * median_time(step, params, x, static, repeats=args.repeats),
            }
        )
    for key in ("kept MiB", "XLA temp MiB", "fwd+bwd ms"):
        for row in rows:
            row[f"{key} / default"] = row[key] / rows[0][key]
    return rows


def kept_for_backward(f, *args) -> int:
    """Bytes of the arrays that JAX keeps from `f`'s forward for its backward (`jax.vjp`'s
    residuals), the inputs themselves not counted."""
    _, vjp = jax.vjp(f, *args)
    inputs = {id(leaf) for leaf in jax.tree.leaves(args)}
    return sum(leaf.nbytes for leaf in jax.tree.leaves(vjp) if id(leaf) not in inputs)


def main(argv=None) -> list[dict]:
    from _timing import machine, print_table, write_results

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    args = p.parse_args(argv)
    rows = measure(args)
    title = f"MoE layer, weights after / before the down projection, {machine()}"
    print_table(rows, title)
    meta = {"machine": machine(), **vars(args), "out": str(args.out)}
    write_results(args.out, "weights_before_down", rows, meta)
    return rows


if __name__ == "__main__":
    main()
