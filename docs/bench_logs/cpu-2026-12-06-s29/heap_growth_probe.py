"""A jitted function returning a fresh 64 MiB array, called 40 times after keep_freed_memory():
fresh MB per call and glibc's arena statistics (mallinfo2), every call.

    python docs/bench_logs/cpu-2026-12-06-s29/heap_growth_probe.py
"""
import resource, sys, ctypes
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI
import dropless
print(dropless.keep_freed_memory())
import jax, jax.numpy as jnp
fresh = jax.jit(lambda x: jnp.broadcast_to(x, (4096, 4096)) + 1.0)
x = jnp.ones(4096)
for i in range(40):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = fresh(x); y.block_until_ready(); del y
    m = libc.mallinfo2()
    print(i, round((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 2**20), "arena MB", m.arena>>20, "mmapped", m.hblks, m.hblkhd>>20, "free", m.fordblks>>20, "top", m.keepcost>>20)
