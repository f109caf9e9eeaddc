"""Variants: argv[1] = late (all three settings after JAX's first computation) or noarena (the
thresholds only, before JAX starts).

    cd experiments && PYTHONPATH=. python ../docs/bench_logs/cpu-2026-12-06-s29/malloc_probe2.py {late,noarena}
"""
import pathlib
import ctypes, sys, runpy
libc = ctypes.CDLL("libc.so.6")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
mode = sys.argv[1]
def apply(arena=True):
    if arena: libc.mallopt(M_ARENA_MAX, 1)
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30); libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
if mode == "late":
    import jax, jax.numpy as jnp
    jnp.ones(4).block_until_ready(); (jnp.ones((512,512)) @ jnp.ones((512,512))).block_until_ready()
    apply()
elif mode == "noarena":
    apply(arena=False)
sys.argv = sys.argv[:1]
runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "cpu-2026-12-06" / "faults.py"), run_name="__main__")
