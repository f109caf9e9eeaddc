"""The MoE's row gathers by XLA and by the library's Pallas kernel (Triton lowering), on a GPU.

    python experiments/bench_row_gather.py [--tokens 49152] [--dim 1024] [--k 6]
    python experiments/bench_row_gather.py --tokens 8192 --dim 7168 --k 8    # DeepSeek-V3 width

Two gathers of bf16 rows run at every MoE layer: the dispatch's expansion (`x[order // k]`) and
the combine's backward (`dy[order // k] * w`, with the routing weights' gradient from the same
rows). `dropless.backends.row_gather.gather_rows` loads and stores whole `[32 1024]` tiles and
computes that gradient's dot products while the rows are loaded. Prints each kernel's time
(CUPTI on a GPU, wall time elsewhere) over XLA's for the same work, measured in the same run,
and how far the two results are apart. (No dispatcher uses the kernel: in the train step it
gained nothing measurable.)
"""

import argparse

import jax
import jax.numpy as jnp

from dropless.backends.row_gather import gather_rows

F32 = jnp.float32


def _scaled_and_dots(x, index, w, y):
    gathered = x[index].astype(F32)
    return (gathered * w[:, None]).astype(x.dtype), jnp.sum(gathered * y.astype(F32), 1)


def kernels(tokens: int, dim: int, k: int, interpret: bool = False) -> list[dict]:
    """Kernel time of each gather by XLA and by Pallas, same inputs, checked: "equal" is
    bitwise, "rel err" the largest difference over the largest value (the kernel's dot
    products sum in another order than XLA's). `interpret`: the kernel's Python on any device
    (slow; for tests)."""
    from _timing import kernel_time, median_time

    timed = kernel_time if jax.default_backend() == "gpu" else median_time
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, dim), jnp.bfloat16)
    index = jax.random.permutation(keys[1], tokens * k).astype(jnp.int32) // k
    w = jax.random.uniform(keys[2], (tokens * k,))
    y = jax.random.normal(keys[3], (tokens * k, dim), jnp.bfloat16)
    cases = {
        "expand x[order // k]": (
            lambda x, i: x[i],
            lambda x, i: gather_rows(x, i, interpret=interpret),
            (x, index),
        ),
        "combine bwd dy[order // k] * w, <dy[order // k], y_rows>": (
            _scaled_and_dots,
            lambda x, i, w, y: gather_rows(x, i, w, dot_with=y, interpret=interpret),
            (x, index, w, y),
        ),
    }
    rows = []
    for name, (by_xla, by_pallas, args) in cases.items():
        by_xla, by_pallas = jax.jit(by_xla), jax.jit(by_pallas)
        row = {"gather": name}
        try:
            want, got = jax.tree.leaves(by_xla(*args)), jax.tree.leaves(by_pallas(*args))
            pairs = list(zip(want, got, strict=True))
            xla, pallas = timed(by_xla, *args), timed(by_pallas, *args)
            row |= {
                "xla ms": 1e3 * xla,
                "pallas ms": 1e3 * pallas,
                "pallas / xla": pallas / xla,
                "pallas TB/s written": tokens * k * dim * 2 / pallas / 1e12,
                "equal": all(bool(jnp.array_equal(a, b)) for a, b in pairs),
                "rel err": max(
                    float(jnp.max(jnp.abs(a.astype(F32) - b.astype(F32))) / jnp.max(jnp.abs(a)))
                    for a, b in pairs
                ),
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
    args = parser.parse_args()
    kernels(args.tokens, args.dim, args.k)


if __name__ == "__main__":
    main()
