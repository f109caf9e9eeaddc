"""Is the grouped forward's rare slow state (twenty-ninth session: 2x its usual time for a whole
process) a lack of parallelism? The 256-expert Dirichlet forward of the default grouped matmul,
30 calls in one process, each followed by a dense matmul of the same FLOPs: median and min ms
of each, how many calls of each took over 1.5x their minimum, the process's CPU seconds over
wall seconds during the calls (2 = both cores busy), its context switches, the threads' CPU
spread, and the machine's steal time over the calls (/proc/stat).

    for i in $(seq 30); do python docs/bench_logs/cpu-2026-12-06-s30/slow_forward_probe.py; done
"""

import os
import pathlib
import resource
import statistics
import time

from probe_setup import call_ms, grouped_forward, jax, lhs, rhs, w

f = grouped_forward()
dense = jax.jit(lambda a, b: a @ b)
for _ in range(3):
    f(lhs, rhs).block_until_ready()
    dense(lhs, w).block_until_ready()


def steal_ticks():
    return int(pathlib.Path("/proc/stat").read_text().split()[8])


def thread_cpu():
    """CPU seconds of each thread of this process (utime + stime, clock ticks)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        fields = pathlib.Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out[tid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


usage = resource.getrusage  # of this process
r0, th0, w0 = usage(resource.RUSAGE_SELF), thread_cpu(), time.perf_counter()
s0 = steal_ticks()
ts, ds = [], []
for _ in range(30):
    ts.append(call_ms(f, lhs, rhs))
    ds.append(call_ms(dense, lhs, w))
steal = steal_ticks() - s0
r1, th1, wall = usage(resource.RUSAGE_SELF), thread_cpu(), time.perf_counter() - w0
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
busy = sorted((th1[t] - th0.get(t, 0.0) for t in th1), reverse=True)
print(
    f"grouped median {statistics.median(ts):.1f} ms min {min(ts):.1f} "
    f"slow {sum(t > 1.5 * min(ts) for t in ts)} | dense median {statistics.median(ds):.2f} ms "
    f"min {min(ds):.2f} slow {sum(d > 1.5 * min(ds) for d in ds)} | steal ticks {steal} | "
    f"cpu/wall {cpu / wall:.2f} | "
    f"vol/invol switches {r1.ru_nvcsw - r0.ru_nvcsw}/{r1.ru_nivcsw - r0.ru_nivcsw} | "
    f"busiest threads s {[round(b, 2) for b in busy[:4]]} of {len(busy)} | "
    f"affinity {sorted(os.sched_getaffinity(0))}"
)
