"""Kernel time (CUPTI) of two MoE stages, each in two versions, on the GPU:

- routing's top-k at proxy-2b's and DeepSeek-V3's routing (sigmoid, 8 groups, top-4 groups,
  bias), 16384 tokens: `jax.lax.top_k` (before) against the library's k rounds of argmax;
- `combine_rows` forward+backward at proxy-2b's MoE widths (16384 tokens x top-6, dim 1024,
  bf16 rows): the float32 output cast afterwards (before) against the rows' dtype (now).

A measurement aid for the fourteenth run, not library code: `python bench_route_combine.py`
from experiments/ with the repository on PYTHONPATH."""

import jax
import jax.numpy as jnp
from _timing import kernel_time

from dropless import routing
from dropless.backends import jnp as jnp_backend
from dropless.routing import JnpTopK, RoutingSpec

library_top_k = routing._top_k


def lax_top_k(values, k):
    return jax.lax.top_k(values, k)[1]


TOKENS = 16384


def router(spec):
    return jax.jit(lambda logits, bias: JnpTopK()(logits, bias, spec))


for experts, k in ((64, 6), (256, 8)):
    spec = RoutingSpec(experts, k, "sigmoid", n_group=8, topk_group=4, use_expert_bias=True)
    logits = jax.random.normal(jax.random.key(0), (TOKENS, experts))
    bias = 0.1 * jax.random.normal(jax.random.key(1), (experts,))
    times, ids = {}, {}
    for name, top_k in (("lax.top_k", lax_top_k), ("argmax rounds", library_top_k)) * 2:
        routing._top_k = top_k
        route = router(spec)
        times.setdefault(name, []).append(kernel_time(route, logits, bias))
        ids[name] = route(logits, bias).expert_ids
    routing._top_k = library_top_k
    same = bool((ids["lax.top_k"] == ids["argmax rounds"]).all())
    print(
        f"== route {TOKENS} x {experts} top-{k}: "
        + ", ".join(f"{n} {min(t) * 1e3:.4f} ms" for n, t in times.items())
        + f"; same ids: {same}",
        flush=True,
    )


def combine_before(y_rows, weights, order, inverse):
    """The combine of 2026-12-04's 491bed4^ (6e61036^): a float32 result, cast by the caller."""
    y = jnp_backend._gather_sum(y_rows, inverse.reshape(weights.shape), weights)
    return y.astype(y_rows.dtype)


def combine_before_bwd(res, dy):
    y_rows, weights, order, inverse = res
    tokens, k = weights.shape
    w_rows = weights.reshape(-1)[order]
    d_rows = (dy[order // k] * w_rows[:, None]).astype(y_rows.dtype)
    dw = jnp_backend._gathered_dots(y_rows, inverse.reshape(tokens, k), dy).astype(weights.dtype)
    return d_rows, dw, None, None


@jax.custom_vjp
def combine_f32(y_rows, weights, order, inverse):
    return jnp_backend._gather_sum(y_rows, inverse.reshape(weights.shape), weights)


combine_f32.defvjp(lambda y, w, o, i: (combine_f32(y, w, o, i), (y, w, o, i)), combine_before_bwd)


def combine_old(y_rows, weights, order, inverse):
    return combine_f32(y_rows, weights, order, inverse).astype(y_rows.dtype)


k, dim = 6, 1024
ids = jax.random.randint(jax.random.key(2), (TOKENS * k,), 0, 64)
order = jnp.argsort(ids, stable=True).astype(jnp.int32)
inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
y_rows = jax.random.normal(jax.random.key(3), (TOKENS * k, dim), jnp.bfloat16)
weights = jax.nn.softmax(jax.random.normal(jax.random.key(4), (TOKENS, k)), -1)
dy = jax.random.normal(jax.random.key(5), (TOKENS, dim), jnp.bfloat16)


def fwd_bwd(combine):
    def loss(y, w):
        return jnp.sum(combine(y, w, order, inverse).astype(jnp.float32) * dy)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


times, grads = {}, {}
variants = (
    ("f32 out, cast (before)", combine_old),
    ("rows' dtype (now)", jnp_backend.combine_rows),
)
for name, combine in variants * 2:
    f = fwd_bwd(combine)
    times.setdefault(name, []).append(kernel_time(f, y_rows, weights))
    grads[name] = f(y_rows, weights)[1][0]
a, b = grads.values()
print(
    "== combine fwd+bwd: "
    + ", ".join(f"{n} {min(t) * 1e3:.4f} ms" for n, t in times.items())
    + f"; row gradients equal: {bool((a == b).all())}",
    flush=True,
)
