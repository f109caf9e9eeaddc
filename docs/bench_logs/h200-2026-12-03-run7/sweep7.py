"""Scratch (seventh H200 run): our weight-gradient kernel at band 4 (default) vs 8 vs 16, over a
dense x.T @ g of equal FLOPs, DeepSeek-V3 expert widths, balanced and Dirichlet(1) groups."""

import sys, itertools
import numpy as np
import jax, jax.numpy as jnp

sys.path.insert(0, "experiments")
from _timing import median_time
from dropless.backends import mosaic_gmm as mg

bands = (4, 8, 16)
print(
    "experts x rows, K x N, routing | dense TF/s | weight grad / dense at band "
    + ", ".join(map(str, bands)),
    flush=True,
)
for (e, per), (k, n), routing in itertools.product(
    [(8, 2048), (64, 512), (256, 256)], [(7168, 2048), (2048, 7168)], ["balanced", "dirichlet"]
):
    m = e * per
    rng = np.random.default_rng(e)
    gs = np.full(e, per) if routing == "balanced" else rng.multinomial(m, rng.dirichlet(np.ones(e)))
    gs = jnp.asarray(gs, jnp.int32)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    g = jax.random.normal(jax.random.key(3), (m, n), jnp.bfloat16)
    t_dense = median_time(jax.jit(lambda a, b: a.T @ b), x, g)
    line = [f"{e}x{per} {k}x{n} {routing}", f"{2 * m * k * n / t_dense / 1e12:.0f}"]
    for band in bands:
        cfg = mg.WeightGradConfig(band=band)
        t = median_time(
            jax.jit(lambda a, b, s, cfg=cfg: mg.grouped_weight_grad(a, b, s, config=cfg)), x, g, gs
        )
        line.append(f"b{band} {t_dense / t:.3f}")
    print(" | ".join(line), flush=True)
