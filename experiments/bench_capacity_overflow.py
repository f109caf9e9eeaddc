"""GPU benchmark: jnp-capacity on skewed groups, where rows overflow the capacity slots.

    python experiments/bench_capacity_overflow.py [--experts 256] [--rows-per-expert 256]

One Dirichlet(1) draw of group sizes (seed 1), bf16, K x N = 7168 x 2048. For a few chunk sizes
and capacity factors of `CapacityGroupedMatmul`, and for `ChunkedGroupedMatmul`, prints forward
and forward+backward time over a dense matmul of equal FLOPs timed in the same run (as in
bench_moe.py; >1 is faster than dense). The rows past each expert's slots go through the
chunked loop, whose trip counts are data-dependent; this shows what that loop costs. The
group sizes are an argument of the compiled functions, as they are in a model. Run it with
XLA_FLAGS set to compare compiler settings (docs/benchmarks.md).
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from _timing import fwd_bwd, machine, median_time

from dropless.backends.capacity import CapacityGroupedMatmul
from dropless.backends.chunked import ChunkedGroupedMatmul, default_capacity, default_chunk


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--rows-per-expert", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="toy widths: a CPU smoke run")
    args = parser.parse_args()
    e, per = args.experts, args.rows_per_expert
    k, n = (64, 32) if args.tiny else (7168, 2048)
    m = e * per
    print(machine(), "| XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""))
    rng = np.random.default_rng(1)
    sizes = jnp.asarray(rng.multinomial(m, rng.dirichlet(np.ones(e))), jnp.int32)
    slots = default_capacity(m, e, 1.25)
    past = int(jnp.maximum(sizes - slots, 0).sum())
    print(f"max/mean group {float(sizes.max()) / per:.2f}, rows past {slots} slots: {past} of {m}")
    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (e, k, n)) / k**0.5).astype(jnp.bfloat16)

    cotangent = jax.random.normal(keys[2], (m, n), jnp.bfloat16)  # for fwd_bwd

    dense = lambda a, b, s: a @ b  # noqa: E731
    t_dense = median_time(jax.jit(dense), lhs, rhs[0], sizes)
    t_dense_fb = median_time(fwd_bwd(dense), lhs, rhs[0], sizes, cotangent)
    quarter = default_chunk(m, e)  # the default chunk before it became the mean group size
    variants = {  # the overflow loop walks as the platform's default does
        f"capacity chunk={chunk} cf={cf}": CapacityGroupedMatmul(capacity_factor=cf, chunk=chunk)
        for cf, chunk in [(1.25, quarter), (1.25, 128), (1.25, 256), (1.25, 512), (2.0, 256)]
    }
    variants[f"capacity chunk={default_chunk(m, e, per_group=1)} (default)"] = (
        CapacityGroupedMatmul()
    )
    variants["chunked"] = ChunkedGroupedMatmul()
    for name, gmm in variants.items():
        f = lambda a, b, s, gmm=gmm: gmm(a, b, s)  # noqa: E731
        args = (lhs, rhs, sizes)
        t, t_fb = median_time(jax.jit(f), *args), median_time(fwd_bwd(f), *args, cotangent)
        print(
            f"{name:34s} fwd/dense {t_dense / t:.3f}  fwd+bwd/dense {t_dense_fb / t_fb:.3f}"
            f"  fwd {t * 1e3:.1f} ms  fwd+bwd {t_fb * 1e3:.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
