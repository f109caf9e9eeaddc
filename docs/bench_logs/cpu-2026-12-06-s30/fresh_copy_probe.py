"""Does the grouped forward's slow state belong to where its weights sit in memory? One process:
10 calls on the weights, then 10 on a fresh copy of them (new pages; the old ones kept alive),
then 10 on a fresh copy of the rows, then 10 on the first weights again: median ms of each,
and how much of the process's memory is THP-backed (AnonHugePages, /proc/self/smaps_rollup).

    for i in $(seq 40); do python docs/bench_logs/cpu-2026-12-06-s30/fresh_copy_probe.py; done
"""

import pathlib
import statistics

from probe_setup import call_ms, grouped_forward, jax, lhs, rhs

f = grouped_forward()
copy = jax.jit(lambda a: a * 1.0 + 0.0)  # a new buffer with the same values


def median_ms(a, b, n=10):
    call_ms(f, a, b)
    return statistics.median(call_ms(f, a, b) for _ in range(n))


first = median_ms(lhs, rhs)
rhs2 = copy(rhs).block_until_ready()
fresh_w = median_ms(lhs, rhs2)
lhs2 = copy(lhs).block_until_ready()
fresh_x = median_ms(lhs2, rhs)
again = median_ms(lhs, rhs)
rollup = pathlib.Path("/proc/self/smaps_rollup").read_text().splitlines()
thp_kb = next(line.split()[1] for line in rollup if line.startswith("AnonHugePages"))
print(
    f"weights {first:.1f} | fresh weights {fresh_w:.1f} | fresh rows {fresh_x:.1f} | "
    f"weights again {again:.1f} ms | {thp_kb} kB THP"
)
