"""Fresh pages and time of faults.py's grouped fwd+bwd with (argv[1] = mallopt) and without the
three mallopt settings made before JAX starts (twenty-ninth session, run before the library
had keep_freed_memory).

    cd experiments && PYTHONPATH=. python ../docs/bench_logs/cpu-2026-12-06-s29/malloc_probe.py {none,mallopt}
"""
import pathlib
import ctypes, sys, runpy
if sys.argv[1:2] == ["mallopt"]:
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    print("arena", libc.mallopt(M_ARENA_MAX, 1),
          "mmap", libc.mallopt(M_MMAP_THRESHOLD, 1 << 30),
          "trim", libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
sys.argv = sys.argv[:1]
runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "cpu-2026-12-06" / "faults.py"), run_name="__main__")
