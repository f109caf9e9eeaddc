"""Scratch: the warp-specialised Mosaic weight gradient vs JAX's transposed_ragged_dot, H200."""
import sys, itertools, traceback
import numpy as np
import jax, jax.numpy as jnp
sys.path.insert(0, "experiments")
from _timing import median_time
from dropless.backends import mosaic_gmm as mg
from dropless.backends import pallas

def ref(x, g, gs):
    owner = jnp.repeat(jnp.arange(gs.shape[0]), gs, total_repeat_length=x.shape[0])
    valid = jnp.arange(x.shape[0]) < gs.sum()
    oh = jax.nn.one_hot(jnp.where(valid, owner, -1), gs.shape[0], dtype=jnp.float32)
    return jnp.einsum("re,ri,ro->eio", oh, x.astype(jnp.float32), g.astype(jnp.float32))

rng = np.random.default_rng(0)
ok = True
for (rows, k, n, e), layout in itertools.product(
        [(1000, 256, 256, 16), (4096, 512, 128, 8), (640, 1024, 256, 64)],
        ["random", "empty-and-one", "all-in-one", "short"]):
    if layout == "random": gs = rng.multinomial(rows, rng.dirichlet(np.ones(e)))
    elif layout == "empty-and-one": gs = np.zeros(e, int); gs[e // 2] = rows - 1; gs[0] = 1
    elif layout == "all-in-one": gs = np.zeros(e, int); gs[-1] = rows
    else: gs = rng.multinomial(rows - 37, np.ones(e) / e)
    gs = jnp.asarray(gs, jnp.int32)
    x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
    g = jax.random.normal(jax.random.key(2), (rows, n), jnp.bfloat16)
    try:
        out = jax.jit(mg.grouped_weight_grad)(x, g, gs)
        r = ref(x, g, gs)
        err = float(np.abs(np.asarray(out, np.float32) - np.asarray(r)).max() / np.abs(np.asarray(r)).max())
        print(f"exact? rows={rows} k={k} n={n} e={e} {layout}: rel err {err:.2e}", "OK" if err < 1e-2 else "BAD", flush=True)
        ok &= err < 1e-2
    except Exception:
        print(f"FAILED rows={rows} {layout}", flush=True); traceback.print_exc(limit=2); ok = False; break
if not ok: sys.exit(0)
cfgs = {"128x2x128 s3": mg.WeightGradConfig(), "128x2x128 s3 b8": mg.WeightGradConfig(band=8), "64x2x128 s4": mg.WeightGradConfig(tile_m=64, max_concurrent_steps=4)}
for (e, per), (k, n), routing in itertools.product([(8, 2048), (64, 512), (256, 256)], [(7168, 2048), (2048, 7168)], ["balanced", "dirichlet"]):
    m = e * per
    gs = np.full(e, per) if routing == "balanced" else np.random.default_rng(0).multinomial(m, np.random.default_rng(e).dirichlet(np.ones(e)))
    gs = jnp.asarray(gs, jnp.int32)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    g = jax.random.normal(jax.random.key(3), (m, n), jnp.bfloat16)
    tdw = median_time(jax.jit(lambda a, b: a.T @ b), x, g)
    line = [f"{e}x{per} {k}x{n} {routing}"]
    tj = median_time(jax.jit(lambda a, b, s: pallas.run_op("wgrad", a, b, s, pallas.BlockConfig())), x, g, gs)
    line.append(f"jax {tdw/tj:.3f}")
    for name, cfg in cfgs.items():
        try:
            t = median_time(jax.jit(lambda a, b, s, cfg=cfg: mg.grouped_weight_grad(a, b, s, config=cfg)), x, g, gs)
            line.append(f"{name} {tdw/t:.3f}")
        except Exception as err:
            line.append(f"{name} error {str(err)[:150]}")
    print(" | ".join(line), flush=True)
