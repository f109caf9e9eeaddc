"""Fill and add of the same bytes in bf16, float32 and uint32 on the GPU, kernel time (CUPTI):
do XLA's elementwise kernels move bf16 at the bandwidth of 4-byte types? A measurement aid for
the fourteenth run (call E, run inline from experiments/ as `python -` with this text), not
library code."""

import jax
import jax.numpy as jnp
from _timing import kernel_time

n = 98304
for dt, width in (
    (jnp.bfloat16, 1024),
    (jnp.float32, 512),
    (jnp.uint32, 512),
    (jnp.bfloat16, 2048),
):
    src = jnp.ones((1, width), dt)
    r = jnp.ones((n, width), dt)
    fill = jax.jit(lambda s, r: jnp.broadcast_to(s, r.shape))
    add = jax.jit(lambda s, r: r + s)
    mb = n * width * jnp.dtype(dt).itemsize / 1e6
    tf = min(kernel_time(fill, src, r) for _ in range(3))
    ta = min(kernel_time(add, src, r) for _ in range(3))
    print(
        f"== {jnp.dtype(dt).name} [{n} {width}] ({mb:.0f} MB): fill {tf * 1e3:.4f} ms "
        f"({mb / 1e3 / tf / 1e3:.2f} TB/s written), add {ta * 1e3:.4f} ms "
        f"({2 * mb / 1e3 / ta / 1e3:.2f} TB/s read+written)",
        flush=True,
    )
