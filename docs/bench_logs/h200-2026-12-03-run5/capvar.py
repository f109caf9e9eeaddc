"""jnp-capacity variants on the H200, bf16, K x N = 7168 x 2048: fwd and fwd+bwd over dense."""

import sys, functools

sys.path.insert(0, "experiments")
import jax, jax.numpy as jnp, numpy as np
from _timing import median_time
from dropless.backends import jnp as J


def slot_bf16(x, rhs, contract_rhs_dim):
    spec = "eci,eio->eco" if contract_rhs_dim == 1 else "eco,eio->eci"
    return jnp.einsum(spec, x, rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def saved(lhs, rhs, gs, capacity, chunk):
    return J._capacity_fwd(lhs, rhs, gs, capacity, chunk)[0]


def saved_fwd(lhs, rhs, gs, capacity, chunk):
    layout = J.SlotLayout.of(gs, lhs.shape[0], capacity)
    xs = J._gather_slots(lhs, layout)
    y = J._gather_rows(J._slot_matmul(xs, rhs, 1), layout)
    ov = J._chunked_matmul(lhs, rhs, gs, chunk, capacity, 1)
    return jnp.where(layout.in_slots[:, None], y, ov), (lhs, xs, rhs, gs, layout)


def saved_bwd(capacity, chunk, res, g):
    lhs, xs, rhs, gs, layout = res
    g = jax.lax.optimization_barrier(g.astype(lhs.dtype))
    gsl = J._gather_slots(g, layout)
    dl = J._gather_rows(J._slot_matmul(gsl, rhs, 2), layout)
    ov = J._chunked_matmul(g, rhs, gs, chunk, capacity, 2)
    dl = jnp.where(layout.in_slots[:, None], dl, ov)
    drhs = J._batched_weight_grad(xs, gsl, rhs.dtype)
    starts, sizes = J._segments(gs, capacity)
    return dl, J._add_row_chunks(drhs, lhs, g, starts, sizes, chunk), None


saved.defvjp(saved_fwd, saved_bwd)


def fb(f):
    return jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32)), argnums=(0, 1)))


k, n = 7168, 2048
orig = J._slot_matmul
for e, per in [(8, 2048), (64, 512), (256, 256)]:
    m = e * per
    kk = jax.random.split(jax.random.key(0), 2)
    lhs = jax.random.normal(kk[0], (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(kk[1], (e, k, n)) / k**0.5).astype(jnp.bfloat16)
    dense = lambda a, b: a @ b
    td, tdb = median_time(jax.jit(dense), lhs, rhs[0]), median_time(fb(dense), lhs, rhs[0])
    rng = np.random.default_rng(e)
    for routing in ["balanced", "dirichlet"]:
        sizes = (
            np.full(e, per)
            if routing == "balanced"
            else rng.multinomial(m, rng.dirichlet(np.ones(e)))
        )
        gs = jnp.asarray(sizes, jnp.int32)
        cap = J.default_capacity(m, e, 1.25)
        chunk = J.default_chunk(m, e, per_group=1)
        vs = {
            "current": lambda a, b: J.CapacityGroupedMatmul()(a, b, gs),
            "cf1.0": lambda a, b: J.CapacityGroupedMatmul(capacity_factor=1.0)(a, b, gs),
            "bf16-slot-out": "patch",
            "saved-slots": lambda a, b: saved(a, b, gs, cap, chunk),
        }
        for name, f in vs.items():
            if f == "patch":
                J._slot_matmul = slot_bf16
                f = lambda a, b: J.capacity_grouped_matmul(a, b, gs, cap, chunk)
            try:
                t, tb = median_time(jax.jit(f), lhs, rhs), median_time(fb(f), lhs, rhs)
                print(
                    f"{e:4d}x{per:<5d} {routing:9s} {name:14s} fwd/dense {td / t:.3f} fwd+bwd/dense {tdb / tb:.3f}  ({t * 1e3:.2f} / {tb * 1e3:.2f} ms; dense {td * 1e3:.2f} / {tdb * 1e3:.2f})",
                    flush=True,
                )
            except Exception as err:
                print(e, routing, name, "error", str(err)[:300], flush=True)
            J._slot_matmul = orig
