"""Shared helpers for the benchmark scripts: timing, tables, result files."""

import csv
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp


def median_time(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time of fn(*args) in seconds, after warm-up (compilation excluded)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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


def print_table(rows: list[dict], title: str = "") -> None:
    if title:
        print(f"\n{title}")
    if not rows:
        return
    keys = list(rows[0])
    cells = [[_fmt(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def write_results(out: pathlib.Path, name: str, rows: list[dict], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if rows:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(out / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


def machine() -> str:
    d = jax.devices()[0]
    return (
        f"{d.platform}:{getattr(d, 'device_kind', '')} x{jax.device_count()}, jax {jax.__version__}"
    )
