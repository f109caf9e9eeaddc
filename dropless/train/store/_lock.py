"""An exclusive lock on a run directory, so that two runs never write into one.

The lock is `fcntl.flock` on `<out_dir>/.lock`, held for the whole run. The operating system
releases it when the process ends, however it ends (SIGKILL included), so a killed run never
leaves a stale lock behind. The file records the holder's pid and host, which a refused run
names.
"""

import fcntl
import json
import os
import socket

LOCK_FILE = ".lock"


class RunDirectoryLocked(RuntimeError):
    """Another live process holds the run directory."""


class RunLock:
    """Takes the lock of `out_dir` on construction; `release()` gives it back."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, LOCK_FILE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirectoryLocked(
                f"{out_dir} is in use by another run ({holder}); wait for it to end or choose "
                "another --out-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        os.fsync(fd)
        self._fd: int | None = fd

    def release(self) -> None:
        """Unlocks (the file stays: removing it would race with a run taking it)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {holder['pid']} on host {holder['host']}"
    except (ValueError, KeyError, TypeError):
        return "its pid is not recorded yet"
