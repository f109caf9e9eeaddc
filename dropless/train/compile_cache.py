"""JAX's persistent compilation cache, as the `dropless` command uses it."""

import os

import jax


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
    Returns the directory in use. JAX writes entries in place: a process killed while writing
    one can leave it truncated; empty the directory if a run then aborts while starting."""
    if directory is not None or not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", directory or default_cache_dir())
    # the model's initialisation compiles many small programs: keep those too
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return jax.config.jax_compilation_cache_dir
