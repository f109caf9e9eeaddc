"""The grouped forward's slow episodes against memory bandwidth: one process, for `argv[1]`
seconds, round after round of the 256-expert Dirichlet forward (the default chunk of 16 rows, and
chunks of 64 rows), a dense matmul of the same FLOPs (cache-sized operands) and a copy of the
128 MB weights (GB/s read + written); one line per about 10 s with the medians of each and,
where `argv[2]` names the built `pingpong.c`, the round trip of a cache line between the two
CPUs measured after each 10 s.

    python docs/bench_logs/cpu-2026-12-06-s30/episode_probe.py 600
    gcc -O2 -pthread docs/bench_logs/cpu-2026-12-06-s30/pingpong.c -o /tmp/pingpong
    python docs/bench_logs/cpu-2026-12-06-s30/episode_probe.py 900 /tmp/pingpong
"""

import statistics
import subprocess
import sys
import time

from probe_setup import call_ms, grouped_forward, jax, lhs, rhs, w

grouped = grouped_forward()
grouped64 = grouped_forward(chunk=64)
dense = jax.jit(lambda a, b: a @ b)
copy = jax.jit(lambda a: a + 1.0)


for fn, args in ((grouped, (lhs, rhs)), (grouped64, (lhs, rhs)), (dense, (lhs, w)), (copy, (rhs,))):
    call_ms(fn, *args)
end, start = time.time() + float(sys.argv[1]), time.time()
while time.time() < end:
    g, g64, d, c, t0 = [], [], [], [], time.time()
    while time.time() - t0 < 10:
        g.append(call_ms(grouped, lhs, rhs))
        g64.append(call_ms(grouped64, lhs, rhs))
        d.append(call_ms(dense, lhs, w))
        c.append(call_ms(copy, rhs))
    gbs = 2 * rhs.nbytes / statistics.median(c) / 1e6
    trip = ""
    if len(sys.argv) > 2:
        ns = subprocess.run([sys.argv[2]], capture_output=True, text=True).stdout.strip()
        trip = f" | ping-pong {ns} ns"
    print(
        f"t {time.time() - start:5.0f} s | grouped {statistics.median(g):5.1f} ms | "
        f"chunk 64 {statistics.median(g64):5.1f} ms | "
        f"dense {statistics.median(d):5.2f} ms | "
        f"copy {statistics.median(c):5.1f} ms ({gbs:4.1f} GB/s){trip}",
        flush=True,
    )
