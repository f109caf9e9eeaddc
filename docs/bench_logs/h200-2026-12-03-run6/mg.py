"""Scratch: the warp-specialised Mosaic grouped matmul vs JAX's ragged_dot_mgpu vs dense, H200."""
import sys, time, statistics, traceback, itertools
import numpy as np
import jax, jax.numpy as jnp
sys.path.insert(0, "experiments")
from _timing import median_time
from dropless.backends import mosaic_gmm as mg
from dropless.backends import pallas
mg.load()
print(jax.devices(), jax.__version__, flush=True)

def ref(lhs, rhs, gs, t):
    owner = jnp.repeat(jnp.arange(gs.shape[0]), gs, total_repeat_length=lhs.shape[0])
    owner = jnp.where(jnp.arange(lhs.shape[0]) < gs.sum(), owner, gs.shape[0] - 1)
    out = []
    for e in range(gs.shape[0]):
        w = rhs[e].T if t else rhs[e]
        out.append(lhs.astype(jnp.float32) @ w.astype(jnp.float32))
    out = jnp.stack(out, 1)
    return jnp.take_along_axis(out, owner[:, None, None], 1)[:, 0]

# correctness
rng = np.random.default_rng(0)
CHECK = {"128x2x64": mg.KernelConfig(tile_n=64, band=8), "64x2x128": mg.KernelConfig(tile_m=64), "128x2x128 s3": mg.KernelConfig(max_concurrent_steps=3)}
for (rows, k, n, e), layout, t, cname in itertools.product(
        [(1000, 256, 512, 16), (4096, 512, 256, 8), (640, 1024, 256, 64)],
        ["random", "empty-and-one", "all-in-one", "short"], [False, True], CHECK):
    cfg = CHECK[cname]
    if layout == "random": gs = rng.multinomial(rows, rng.dirichlet(np.ones(e)))
    elif layout == "empty-and-one": gs = np.zeros(e, int); gs[e // 2] = rows - 1; gs[0] = 1
    elif layout == "all-in-one": gs = np.zeros(e, int); gs[-1] = rows
    else: gs = rng.multinomial(rows - 37, np.ones(e) / e)   # rows past the groups
    gs = jnp.asarray(gs, jnp.int32)
    lhs = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.key(2), (e, n, k) if t else (e, k, n)) / k**0.5).astype(jnp.bfloat16)
    try:
        out = jax.jit(lambda a, b, s: mg.grouped_matmul(a, b, s, transpose_rhs=t, config=cfg))(lhs, rhs, gs)
        r = ref(lhs, rhs, gs, t)
        err = float(jnp.abs(out.astype(jnp.float32) - r).max() / jnp.abs(r).max())
        print(f"exact? {cname} rows={rows} k={k} n={n} e={e} {layout} transpose={t}: rel err {err:.2e}", "OK" if err < 1e-2 else "BAD", flush=True)
    except Exception:
        print(f"FAILED {cname} rows={rows} {layout} transpose={t}"); traceback.print_exc(limit=3)

# speed
configs = {
    "128x2x64 b8": mg.KernelConfig(tile_n=64, band=8),
    "128x2x64 b16 s6": mg.KernelConfig(tile_n=64, band=16, max_concurrent_steps=6),
    "128x2x128 s3 b4": mg.KernelConfig(max_concurrent_steps=3),
    "64x2x128 b8": mg.KernelConfig(tile_m=64, band=8),
}
for (e, per), (k, n), routing in itertools.product([(8, 2048), (64, 512), (256, 256)], [(7168, 2048), (2048, 7168)], ["balanced", "dirichlet"]):
    m = e * per
    gs = np.full(e, per) if routing == "balanced" else np.random.default_rng(0).multinomial(m, np.random.default_rng(e).dirichlet(np.ones(e)))
    gs = jnp.asarray(gs, jnp.int32)
    lhs = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.key(2), (e, k, n)) / k**0.5).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.key(3), (m, n), jnp.bfloat16)
    flops = 2 * m * k * n
    td = median_time(jax.jit(lambda a, b: a @ b), lhs, rhs[0])
    tdg = median_time(jax.jit(lambda a, b: a @ b.T), g, rhs[0])
    line = [f"{e}x{per} {k}x{n} {routing}: dense {flops/td/1e12:.0f} TF/s"]
    def both(name, f_fwd, f_dg):
        try:
            a = median_time(jax.jit(f_fwd), lhs, rhs, gs); b = median_time(jax.jit(f_dg), g, rhs, gs)
            line.append(f"{name} fwd {td/a:.3f} dgrad {tdg/b:.3f}")
        except Exception as err:
            line.append(f"{name} error {str(err)[:200]}")
    both("jax-mgpu", lambda a, b, s: pallas.run_op("fwd", a, b, s, pallas.BlockConfig()),
                     lambda a, b, s: pallas.run_op("dgrad", a, b, s, pallas.BlockConfig()))
    for name, cfg in configs.items():
        both(name, lambda a, b, s, cfg=cfg: mg.grouped_matmul(a, b, s, config=cfg),
                   lambda a, b, s, cfg=cfg: mg.grouped_matmul(a, b, s, transpose_rhs=True, config=cfg))
    try:
        tw = median_time(jax.jit(lambda a, b, s: pallas.run_op("wgrad", a, b, s, pallas.BlockConfig())), lhs, g, gs)
        tdw = median_time(jax.jit(lambda a, b: a.T @ b), lhs, g)
        line.append(f"jax wgrad {tdw/tw:.3f}")
    except Exception as err:
        line.append(f"wgrad error {str(err)[:200]}")
    print(" | ".join(line), flush=True)
