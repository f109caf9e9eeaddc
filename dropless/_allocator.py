"""Keeping freed host memory for reuse, so that the CPU backend's large buffers stay cheap
(private: the `dropless` command and the benchmarks call it).

XLA's CPU runtime mallocs every output and temporary buffer of a call afresh. glibc serves a
block above its mmap threshold (which adapts up to 32 MiB at most) with fresh pages, and returns
them at `free`; and XLA allocates from its worker threads, whose malloc arenas are heaps of at
most 64 MiB. So a buffer of more than 32 MiB is page-faulted in at every call; raising the
thresholds helps up to 64 MiB, and above that only if all threads share the main arena. The
256-expert grouped matmul's weight gradient is such a buffer (134 MB): its fwd+bwd spends about
a third of its time in page faults without this setting.

`keep_freed_memory()` makes glibc keep such blocks for reuse: one arena for all threads, and
blocks up to `threshold` bytes served from, and returned to, the heap (which is not trimmed
below that much free memory). It must run before JAX's CPU client starts its threads, that is
before the first JAX computation. The `dropless` command and bench_grouped_matmul.py call it;
a script that drives dropless from Python may call it first thing. The price is host memory:
freed blocks stay with the process, and glibc does not always fit a new block into a freed one
of the same size, so the heap holds some spare blocks (peak RSS of the tiny preset's training
755 -> 802 MB, of a 256-expert grouped-matmul fwd+bwd 820 -> 981 MB).
"""

import ctypes
import os
import sys
import warnings

from jax._src import xla_bridge

# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_applied = False


def keep_freed_memory(threshold: int = 1 << 30, *, warn: bool = True) -> bool:
    """Has glibc keep freed blocks of up to `threshold` bytes for reuse (see the module).

    Returns whether the setting is in force: False off glibc (macOS, musl: nothing to do), or
    once JAX has started (too late: its threads already have their arenas; warns unless
    `warn=False`). Calling it again is harmless.
    """
    global _applied
    if not isinstance(threshold, int) or not 1 << 20 <= threshold < 1 << 31:
        # mallopt takes a C int
        raise ValueError(
            f"threshold ({threshold!r}) must be an int from 1 MiB (2**20) to 2**31 - 1 bytes"
        )
    if _applied:
        return True
    if not _is_glibc():
        return False
    if xla_bridge.backends_are_initialized():
        if warn:
            warnings.warn(
                "keep_freed_memory() had no effect: call it before the first JAX computation",
                RuntimeWarning,
                stacklevel=2,
            )
        return False
    libc = ctypes.CDLL("libc.so.6")
    settings = [(_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, threshold), (_M_TRIM_THRESHOLD, threshold)]
    # mallopt returns 1 on success; an older glibc refuses thresholds above 32 MiB (the arena
    # limit then stays set, which alone changes little)
    _applied = all(libc.mallopt(param, value) == 1 for param, value in settings)
    return _applied


def _is_glibc() -> bool:
    """Whether this process runs on glibc (Linux): the C library whose mallopt is called."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False
