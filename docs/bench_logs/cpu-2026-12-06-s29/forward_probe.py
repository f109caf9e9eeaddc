"""The default grouped matmul's forward alone, 20 calls in one process: median and min ms, and the
fresh MB of each call; argv: {keep,default} experts {balanced,dirichlet}.

    python docs/bench_logs/cpu-2026-12-06-s29/forward_probe.py default 256 dirichlet
"""
import pathlib, resource, sys, time, statistics
import dropless
print(sys.argv[1], dropless.keep_freed_memory() if sys.argv[1] == "keep" else False, end=" ")
import jax, jax.numpy as jnp
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "experiments"))
from bench_grouped_matmul import group_sizes
from dropless.backends.jnp import ChunkedGroupedMatmul
E = int(sys.argv[2]); routing = sys.argv[3]
keys = jax.random.split(jax.random.key(0), 4)
lhs = jax.random.normal(keys[0], (8192, 256)); rhs = jax.random.normal(keys[2], (E, 256, 512))
gs = jnp.asarray(group_sizes(routing, E, 8192, 1.0, seed=E), jnp.int32)
g = ChunkedGroupedMatmul()
f = jax.jit(lambda a, b: g(a, b, gs))
for _ in range(3): f(lhs, rhs).block_until_ready()
ts, fl = [], []
for _ in range(20):
    b = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t = time.perf_counter()
    f(lhs, rhs).block_until_ready()
    ts.append((time.perf_counter() - t) * 1e3); fl.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - b) * 4096 >> 20)
print(f"E{E} {routing} median {statistics.median(ts):.1f} ms min {min(ts):.1f}, fresh MB {fl}")
