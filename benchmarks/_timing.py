"""Shared helpers for the benchmark scripts: kernel timing and a value-and-gradient to time.
The wall-clock timer, tables and result files are the experiments' (`experiments/_common.py`),
so that both folders write the same JSON + CSV."""

import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

from _common import machine, median_time, print_table, write_results  # noqa: E402

__all__ = ["fwd_bwd", "kernel_time", "machine", "median_time", "print_table", "write_results"]


def kernel_time(fn, *args, iterations: int = 5) -> float:
    """Median GPU time of fn(*args)'s kernels in seconds over `iterations` calls (CUPTI, via
    Mosaic GPU's profiler): launch gaps and host work left out, which wall-clock timing of
    ~1 ms calls lets in. Needs a GPU."""
    from jax.experimental.mosaic.gpu import profiler

    _, times = profiler.measure(fn, iterations=iterations)(*args)
    return statistics.median(times) / 1e3


def fwd_bwd(f):
    """jit of `(a, b, *rest, cotangent) -> (loss, (d loss/da, d loss/db))` for
    `loss = sum(f(a, b, *rest) * cotangent)`. The loss is returned and the cotangent is an
    argument, so XLA must run the forward (a gradient alone does not need it: jax.grad of a
    plain sum times only the backward) and cannot simplify a cotangent of ones."""

    def loss(a, b, *rest):
        *args, cotangent = rest
        return jnp.sum(f(a, b, *args).astype(jnp.float32) * cotangent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
