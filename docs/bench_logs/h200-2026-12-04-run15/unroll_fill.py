"""Fill and add of the same bytes in bf16 and float32, kernel time (CUPTI), each compiled with
XLA's default loop unrolling and with `xla_gpu_experimental_max_unroll_factor` raised (per-jit
compiler options, one process): does the unroll limit explain bf16's half byte rate (run 14,
e4_fill_dtype.log)? A measurement aid for the fifteenth run, not library code; run from
experiments/."""

import jax
import jax.numpy as jnp
from _timing import kernel_time

n = 98304
for factor in (None, 8, 16):
    options = {} if factor is None else {"xla_gpu_experimental_max_unroll_factor": factor}
    for dt, width in ((jnp.bfloat16, 1024), (jnp.float32, 512)):
        src = jnp.ones((1, width), dt)
        r = jnp.ones((n, width), dt)
        try:
            fill = jax.jit(lambda s, r: jnp.broadcast_to(s, r.shape), compiler_options=options)
            add = jax.jit(lambda s, r: r + s, compiler_options=options)
            tf = min(kernel_time(fill, src, r) for _ in range(3))
            ta = min(kernel_time(add, src, r) for _ in range(3))
        except Exception as e:  # an option this XLA does not know
            print(f"== unroll {factor}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            break
        mb = n * width * jnp.dtype(dt).itemsize / 1e6
        print(
            f"== unroll {factor or 'default'}, {jnp.dtype(dt).name} [{n} {width}] ({mb:.0f} MB): "
            f"fill {tf * 1e3:.4f} ms ({mb / 1e3 / tf / 1e3:.2f} TB/s), "
            f"add {ta * 1e3:.4f} ms ({2 * mb / 1e3 / ta / 1e3:.2f} TB/s)",
            flush=True,
        )
