"""What the three probes of this folder share: the allocator setting (before JAX computes
anything), the 256-expert Dirichlet forward's operands (8192 rows, 256 in, 512 out, float32),
a dense right-hand side of the same FLOPs, the default grouped matmul for those groups, and the
timing of one call."""

import pathlib
import sys
import time

import dropless

dropless.keep_freed_memory()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "experiments"))
from bench_grouped_matmul import group_sizes  # noqa: E402
from dropless.backends.jnp import ChunkedGroupedMatmul  # noqa: E402

E = 256
keys = jax.random.split(jax.random.key(0), 4)
lhs = jax.random.normal(keys[0], (8192, 256))
rhs = jax.random.normal(keys[2], (E, 256, 512))
w = jax.random.normal(keys[3], (256, 512))
gs = jnp.asarray(group_sizes("dirichlet", E, 8192, 1.0, seed=E), jnp.int32)


def grouped_forward(chunk=None):
    """The jitted grouped forward of (rows, weights) over the groups `gs`."""
    return jax.jit(lambda a, b: ChunkedGroupedMatmul(chunk=chunk)(a, b, gs))


def call_ms(fn, *args) -> float:
    """Milliseconds of one call of `fn`, to its result's readiness."""
    t = time.perf_counter()
    fn(*args).block_until_ready()
    return (time.perf_counter() - t) * 1e3
