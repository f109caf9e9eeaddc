"""Row gathers as the sort dispatcher makes them, kernel time (CUPTI) on the GPU: 16384 bf16
rows of width 1024 gathered into 98,304 rows (top-6, expert order, as proxy-2b's dispatch),
written several ways, against a fill of the output (the write alone) and a copy of as many bytes. A
measurement aid for the fourteenth run, not library code: `python bench_gather.py` from
experiments/."""

import jax
import jax.numpy as jnp
from _timing import kernel_time

tokens, k, dim = 16384, 6, 1024
ids = jax.random.randint(jax.random.key(0), (tokens * k,), 0, 64)
order = jnp.argsort(ids, stable=True).astype(jnp.int32)
source = order // k
x = jax.random.normal(jax.random.key(1), (tokens, dim), jnp.bfloat16)
rows = jax.random.normal(jax.random.key(2), (tokens * k, dim), jnp.bfloat16)
w = jax.random.uniform(jax.random.key(3), (tokens * k,))


def as_words(a):
    """bf16 pairs as uint32: half the elements, each twice as wide."""
    return jax.lax.bitcast_convert_type(a.reshape(a.shape[0], -1, 2), jnp.uint32)


def from_words(a):
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16).reshape(a.shape[0], -1)


variants = {
    "fill of the output (write floor)": lambda x, i, r: jnp.broadcast_to(x[:1], r.shape),
    "copy of the output bytes (read + write)": lambda x, i, r: r + jnp.bfloat16(1),
    "x[i] (library)": lambda x, i, r: x[i],
    "x.at[i].get(promise_in_bounds)": lambda x, i, r: x.at[i].get(mode="promise_in_bounds"),
    "take(mode=clip)": lambda x, i, r: jnp.take(x, i, axis=0, mode="clip"),
    "as uint32 words": lambda x, i, r: from_words(as_words(x)[i]),
    "x[i] * w, as the combine's backward": lambda x, i, r: (
        x[i].astype(jnp.float32) * w[:, None]
    ).astype(jnp.bfloat16),
    "as uint32 words, then * w": lambda x, i, r: (
        from_words(as_words(x)[i]).astype(jnp.float32) * w[:, None]
    ).astype(jnp.bfloat16),
}
want = x[source]
for name, f in variants.items():
    f = jax.jit(f)
    best = min(kernel_time(f, x, source, rows) for _ in range(3))
    out = f(x, source, rows)
    checked = not any(word in name for word in ("floor", "copy", "* w"))
    same = f", equal: {bool((out == want).all())}" if checked else ""
    print(f"== {name}: {best * 1e3:.4f} ms{same}", flush=True)
