"""The dropless command's default run, timed, with (argv[1] = mallopt) or without the three
mallopt settings; run before the command called keep_freed_memory itself (at 7e6a37c and
later it always does, so "none" then measures the setting too: use rss_probe.py).

    python docs/bench_logs/cpu-2026-12-06-s29/train_probe.py {none,mallopt}
"""
import ctypes, sys, time
if sys.argv[1] == "mallopt":
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-8, 1); libc.mallopt(-3, 1 << 30); libc.mallopt(-1, 1 << 30)
from dropless.cli import main
start = time.perf_counter()
main(["train", "--no-progress", "--out-dir", f"/tmp/probe_run_{sys.argv[1]}_{time.time_ns()}"])
print(sys.argv[1], "wall", round(time.perf_counter() - start, 1))
