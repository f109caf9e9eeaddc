"""Peak RSS and malloc statistics: argv[2] = faults (faults.py) or train (the dropless command's
default run, timed); argv[1] = keep (keep_freed_memory first) or default (the CLI's own call
skipped by marking it applied).

    cd experiments && PYTHONPATH=. python ../docs/bench_logs/cpu-2026-12-06-s29/rss_probe.py {default,keep} {faults,train}
"""
import pathlib
import ctypes, sys, runpy, resource
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI
mode, what = sys.argv[1], sys.argv[2]
if mode == "default":
    import dropless.host_memory as hm; hm._applied = True  # the CLI then leaves glibc alone
if mode == "keep":
    import dropless; print(dropless.keep_freed_memory())
sys.argv = sys.argv[:1]
if what == "faults":
    runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "cpu-2026-12-06" / "faults.py"), run_name="__main__")
else:
    import time
    from dropless.cli import main
    t0 = time.perf_counter(); main(["train", "--no-progress", "--out-dir", f"/tmp/probe_run_{time.time_ns()}"]); print("wall", time.perf_counter() - t0)
m = libc.mallinfo2()
print(mode, what, "maxrss MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10, "arena MB", m.arena >> 20, "free MB", m.fordblks >> 20, "mmapped MB", m.hblkhd >> 20)
