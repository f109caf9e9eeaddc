"""Fresh pages per call of the 256-expert Dirichlet fwd+bwd of the default grouped matmul and
of its dense reference (shapes, keys and groups as in bench_grouped_matmul.py; the operands
are gmm_parts.py's of cpu-2026-12-05, whose dense weight is not scaled), with the size of
XLA's temporary. `mse` as the argument: a loss whose cotangent depends on the forward output
(0.5 * sum((f - t) ** 2)) in place of the benchmark's sum(f * cotangent). Twenty-sixth session.

    cd experiments && PYTHONPATH=. python ../docs/bench_logs/cpu-2026-12-06/faults.py [mse]
"""

import resource
import sys
import time

import jax
import jax.numpy as jnp
from _timing import fwd_bwd
from bench_grouped_matmul import group_sizes

from dropless.backends import jnp as J

ROWS, IN, OUT, EXPERTS = 8192, 256, 512, 256


def mse(f):
    def loss(a, b, target):
        return 0.5 * jnp.sum((f(a, b) - target) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


keys = jax.random.split(jax.random.key(0), 4)
lhs = jax.random.normal(keys[0], (ROWS, IN))
g = jax.random.normal(keys[3], (ROWS, OUT))
w = jax.random.normal(keys[1], (IN, OUT))
rhs = jax.random.normal(keys[2], (EXPERTS, IN, OUT)) / IN**0.5
gs = jnp.asarray(group_sizes("dirichlet", EXPERTS, ROWS, 1.0, seed=EXPERTS), jnp.int32)
chunk = J.default_chunk(ROWS, EXPERTS)
harness = mse if sys.argv[1:] == ["mse"] else fwd_bwd
grouped = harness(lambda a, b: J.chunked_grouped_matmul(a, b, gs, chunk))
dense = harness(lambda a, b: a @ b)
for name, fn, args in [("grouped", grouped, (lhs, rhs, g)), ("dense", dense, (lhs, w, g))]:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
    temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    print(
        f"{name}: {faults * 4096 / 1e6:.1f} MB of fresh pages a call, median "
        f"{sorted(times)[5] * 1e3:.0f} ms, XLA temporary {temp / 1e6:.1f} MB"
    )
