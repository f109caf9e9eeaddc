"""Where the 256-expert Dirichlet forward+backward of the default grouped matmul goes on the
CPU: the forward, the input gradient and the weight gradient of `chunked_grouped_matmul`
timed apart, its fwd+bwd as `bench_grouped_matmul.py` times it, the dense references, and a
bare [256 256 512] float32 fill (the weight gradient's size: what fresh pages cost). Same
operands and groups as bench_grouped_matmul.py (8192 rows, 256 -> 512, Dirichlet(1), seed 256).

    cd experiments && PYTHONPATH=. python ../docs/bench_logs/cpu-2026-12-05/gmm_parts.py
"""

import statistics
import time

import jax
import jax.numpy as jnp
from _timing import fwd_bwd
from bench_grouped_matmul import group_sizes

from dropless.backends import jnp as J

ROWS, IN, OUT, EXPERTS = 8192, 256, 512, 256


def timed(f, *args, n=15):
    """min / median wall ms of n calls after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - start)
    return f"{min(ts) * 1e3:.1f} / {statistics.median(ts) * 1e3:.1f}"


keys = jax.random.split(jax.random.key(0), 4)
lhs = jax.random.normal(keys[0], (ROWS, IN))
g = jax.random.normal(keys[3], (ROWS, OUT))
w = jax.random.normal(keys[1], (IN, OUT))
rhs = jax.random.normal(keys[2], (EXPERTS, IN, OUT)) / IN**0.5
gs = jnp.asarray(group_sizes("dirichlet", EXPERTS, ROWS, 1.0, seed=EXPERTS), jnp.int32)
chunk = J.default_chunk(ROWS, EXPERTS)
parts = {
    "dense forward x @ w": (jax.jit(lambda a, b: a @ b), (lhs, w)),
    "dense fwd+bwd": (fwd_bwd(lambda a, b: a @ b), (lhs, w, g)),
    "forward": (jax.jit(lambda a, b: J._chunked_matmul(a, b, gs, chunk, 0, 1)), (lhs, rhs)),
    "input gradient": (jax.jit(lambda a, b: J._chunked_matmul(a, b, gs, chunk, 0, 2)), (g, rhs)),
    "weight gradient": (
        jax.jit(lambda a, b: J._chunked_weight_grad(a, b, gs, chunk, EXPERTS, jnp.float32)),
        (lhs, g),
    ),
    "fwd+bwd": (fwd_bwd(lambda a, b: J.chunked_grouped_matmul(a, b, gs, chunk)), (lhs, rhs, g)),
    "fill [256 256 512] f32": (
        jax.jit(lambda a: jnp.zeros((EXPERTS, IN, OUT)) + a[0, 0]),
        (lhs,),
    ),
}
print(f"chunk {chunk}; ms, min / median of 15 calls")
for name, (f, args) in parts.items():
    print(f"{name:>26}: {timed(f, *args)}", flush=True)
