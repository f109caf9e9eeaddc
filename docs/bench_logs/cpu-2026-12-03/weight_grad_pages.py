import time, statistics, os
import jax, jax.numpy as jnp

e, s, i, o = 256, 32, 256, 512
k = jax.random.split(jax.random.key(0), 2)
x = jax.random.normal(k[0], (e, s, i))
g = jax.random.normal(k[1], (e, s, o))


def t(f, *a, r=15):
    jax.block_until_ready(f(*a))
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(r):
        st = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - st)
    return statistics.median(ts) * 1e3


w = jax.jit(lambda x, g: jnp.einsum("esi,eso->eio", x, g))
xt = jnp.swapaxes(x, 1, 2)
w2 = jax.jit(lambda xt, g: jnp.einsum("eis,eso->eio", xt, g))
a = jax.random.normal(k[0], (8192, 256))
b = jax.random.normal(k[1], (8192, 512))
d = jax.jit(lambda a, b: a.T @ b)
z = jax.jit(lambda x: jnp.zeros((e, i, o)) + x[0, 0, 0])
print(
    os.environ.get("XLA_FLAGS", "-"),
    f"wgrad {t(w, x, g):.1f}  pretransposed {t(w2, xt, g):.1f}  dense wgrad {t(d, a, b):.1f}  fill {t(z, x):.1f}",
)
