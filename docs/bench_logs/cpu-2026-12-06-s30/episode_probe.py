"""The grouped forward's slow episodes against memory bandwidth: one process, for `argv[1]`
seconds, round after round of the 256-expert Dirichlet forward (the default chunk of 16 rows, and
chunks of 64 rows), a dense matmul of the same FLOPs
(cache-sized operands) and a copy of the 128 MB weights (GB/s read + written); one line per
about 10 s with the medians of each, and, where `argv[2]` names the built `pingpong.c`, the
round trip of a cache line between the two CPUs measured after each 10 s.

    python docs/bench_logs/cpu-2026-12-06-s30/episode_probe.py 600
    gcc -O2 -pthread docs/bench_logs/cpu-2026-12-06-s30/pingpong.c -o /tmp/pingpong
    python docs/bench_logs/cpu-2026-12-06-s30/episode_probe.py 900 /tmp/pingpong
"""

import pathlib
import statistics
import subprocess
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
grouped = jax.jit(lambda a, b: ChunkedGroupedMatmul()(a, b, gs))
grouped64 = jax.jit(lambda a, b: ChunkedGroupedMatmul(chunk=64)(a, b, gs))
dense = jax.jit(lambda a, b: a @ b)
copy = jax.jit(lambda a: a + 1.0)


def ms(fn, *args):
    t = time.perf_counter()
    fn(*args).block_until_ready()
    return (time.perf_counter() - t) * 1e3


for fn, args in ((grouped, (lhs, rhs)), (grouped64, (lhs, rhs)), (dense, (lhs, w)), (copy, (rhs,))):
    ms(fn, *args)
end, start = time.time() + float(sys.argv[1]), time.time()
while time.time() < end:
    g, g64, d, c, t0 = [], [], [], [], time.time()
    while time.time() - t0 < 10:
        g.append(ms(grouped, lhs, rhs))
        g64.append(ms(grouped64, lhs, rhs))
        d.append(ms(dense, lhs, w))
        c.append(ms(copy, rhs))
    gbs = 2 * rhs.nbytes / statistics.median(c) / 1e6
    if len(sys.argv) > 2:
        trip = subprocess.run([sys.argv[2]], capture_output=True, text=True).stdout.strip()
        gbs = f"{gbs:4.1f} GB/s) | ping-pong {trip} ns"
    else:
        gbs = f"{gbs:4.1f} GB/s)"
    print(
        f"t {time.time() - start:5.0f} s | grouped {statistics.median(g):5.1f} ms | "
        f"chunk 64 {statistics.median(g64):5.1f} ms | "
        f"dense {statistics.median(d):5.2f} ms | copy {statistics.median(c):5.1f} ms ({gbs}",
        flush=True,
    )
