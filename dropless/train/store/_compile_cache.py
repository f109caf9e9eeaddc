"""JAX's persistent compilation cache, as the `dropless` command uses it."""

import os
import time

import jax

# JAX's file cache: an entry is `<key>-cache` (the compressed executable) beside `<key>-atime`.
_ENTRY_SUFFIX = "-cache"
_ATIME_SUFFIX = "-atime"
# Touched after each check: only entries written since are checked again.
_CHECKED_MARKER = ".dropless-checked"


try:
    from jax._src.compilation_cache import decompress_executable
except ImportError:  # a JAX without it: only empty entries are caught
    decompress_executable = None


def _decompresses(data: bytes) -> bool:
    if decompress_executable is None:
        return True
    try:
        decompress_executable(data)
    except Exception:  # zstd and zlib raise their own types for a cut-off stream
        return False
    return True


def remove_broken_entries(directory: str) -> list[str]:
    """Removes the cache entries of `directory` that are empty or do not decompress (what a
    process killed while JAX wrote one in place leaves), so that JAX compiles and writes them
    again instead of warning about them in every run. Returns the removed paths; checks only
    entries written since the last check."""
    if not os.path.isdir(directory):
        return []
    marker = os.path.join(directory, _CHECKED_MARKER)
    since = os.path.getmtime(marker) - 1.0 if os.path.exists(marker) else 0.0
    started = time.time()
    removed = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not name.endswith(_ENTRY_SUFFIX):
            continue
        try:
            if os.path.getmtime(path) < since:
                continue
            with open(path, "rb") as f:
                data = f.read()
            if data and _decompresses(data):
                continue
            os.remove(path)
            atime = path.removesuffix(_ENTRY_SUFFIX) + _ATIME_SUFFIX
            if os.path.exists(atime):
                os.remove(atime)
        except OSError:  # removed or replaced by a concurrent process meanwhile
            continue
        removed.append(path)
    try:
        with open(marker, "w"):
            pass
        os.utime(marker, (started, started))
    except OSError:
        pass
    return removed


def default_cache_dir() -> str:
    """$JAX_COMPILATION_CACHE_DIR, else ~/.cache/dropless/jax (under $XDG_CACHE_HOME if set)."""
    configured = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.join(base, "dropless", "jax")


def enable_compile_cache(directory: str | None = None) -> str:
    """Keep every compiled program in a persistent cache, so a later process with the same
    shapes loads its steps instead of compiling them (seconds instead of tens of seconds for
    the tiny model). A cache directory JAX already has is kept unless `directory` is given.
    Returns the directory in use. JAX writes entries in place, so a process killed while
    writing one can leave it empty or cut off: such entries are removed here
    (`remove_broken_entries`) and compiled again."""
    if directory is not None or not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", directory or default_cache_dir())
    remove_broken_entries(jax.config.jax_compilation_cache_dir)
    # the model's initialisation compiles many small programs: keep those too
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return jax.config.jax_compilation_cache_dir
