"""jnp-capacity (bf16 slot output) with nested vs flat overflow loops, H200, bf16, 7168 x 2048."""

import sys, os

sys.path.insert(0, "experiments")
import jax, jax.numpy as jnp, numpy as np
from _timing import median_time
from dropless.backends import jnp as J


def flat_for_each_chunk(starts, sizes, chunk, rows, body, carry):
    counts = (sizes + chunk - 1) // chunk
    ends = jnp.cumsum(counts)

    def per_tile(t, carry):
        e = jnp.clip(jnp.searchsorted(ends, t, side="right"), 0, sizes.shape[0] - 1)
        c = t - (ends[e] - counts[e])
        first, valid = J._chunk_window(starts[e] + c * chunk, sizes[e] - c * chunk, chunk, rows)
        return body(e, first, valid, carry)

    # the trip count rides in the carry: XLA GPU failed evaluating it when it was a bound
    loop = lambda s: (s[0] + 1, s[1], per_tile(s[0], s[2]))
    return jax.lax.while_loop(lambda s: s[0] < s[1], loop, (0, ends[-1], carry))[2]


def flat_add_row_chunks(drhs, lhs, grad_out, starts, sizes, chunk):
    rows, width = lhs.shape
    out_width = grad_out.shape[1]
    chunk = min(chunk, rows)
    counts = (sizes + chunk - 1) // chunk
    ends = jnp.cumsum(counts)

    def per_tile(t, carry):
        drhs, acc = carry
        e = jnp.clip(jnp.searchsorted(ends, t, side="right"), 0, sizes.shape[0] - 1)
        c = t - (ends[e] - counts[e])
        first, valid = J._chunk_window(starts[e] + c * chunk, sizes[e] - c * chunk, chunk, rows)
        x = jnp.where(valid[:, None], jax.lax.dynamic_slice(lhs, (first, 0), (chunk, width)), 0)
        g = jax.lax.dynamic_slice(grad_out, (first, 0), (chunk, out_width))
        acc = jnp.where(c == 0, drhs[e].astype(jnp.float32), acc) + jax.lax.dot_general(
            x, g, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return jax.lax.dynamic_update_index_in_dim(drhs, acc.astype(drhs.dtype), e, 0), acc

    acc = jnp.zeros((width, out_width), jnp.float32)
    loop = lambda s: (s[0] + 1, s[1], per_tile(s[0], s[2]))
    return jax.lax.while_loop(lambda s: s[0] < s[1], loop, (0, ends[-1], (drhs, acc)))[2][0]


nested = (J._for_each_chunk, J._add_row_chunks)
flat = (flat_for_each_chunk, flat_add_row_chunks)


def use(pair):
    J._for_each_chunk, J._add_row_chunks = pair


def fb(f):
    return jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32)), argnums=(0, 1)))


if os.environ.get("CHECK"):
    e, m, k, n = 8, 256, 16, 8
    rng = np.random.default_rng(0)
    gs = jnp.asarray(rng.multinomial(m, rng.dirichlet(np.ones(e))), jnp.int32)
    a = jax.random.normal(jax.random.key(1), (m, k))
    b = jax.random.normal(jax.random.key(2), (e, k, n))
    f = lambda a, b: jnp.sum(
        jnp.sin(J.CapacityGroupedMatmul(capacity_factor=0.5, chunk=8)(a, b, gs))
    )
    res = []
    for pair in (nested, flat):
        use(pair)
        res.append((f(a, b), *jax.grad(f, (0, 1))(a, b)))
    print("max diffs flat vs nested:", [float(jnp.max(jnp.abs(x - y))) for x, y in zip(*res)])
    sys.exit()

k, n = 7168, 2048
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
        for name, pair in [("nested", nested), ("flat", flat)]:
            use(pair)
            f = lambda a, b: J.CapacityGroupedMatmul()(a, b, gs)
            t, tb = median_time(jax.jit(f), lhs, rhs), median_time(fb(f), lhs, rhs)
            print(
                f"{e:4d}x{per:<5d} {routing:9s} {name:7s} fwd/dense {td / t:.3f} fwd+bwd/dense {tdb / tb:.3f}  ({t * 1e3:.2f} / {tb * 1e3:.2f} ms; dense {td * 1e3:.2f} / {tdb * 1e3:.2f})",
                flush=True,
            )
        use(nested)
