"""Contractions that return float32 from low-precision inputs, with a backward in their dtype.

`jnp.einsum(..., preferred_element_type=float32)` is the way to ask for float32 results from
bf16 operands (cuBLAS accumulates in float32 either way). Autodiff's transpose of it, though,
contracts the float32 cotangent with the bf16 operands, so XLA upcasts them and both backward
matmuls run in float32: on an H200 that is TF32 speed at best, several times slower than bf16.
`f32_einsum` rounds the cotangent to the operands' dtype first, as mixed-precision training
does everywhere else, so the backward matmuls run in that dtype (still accumulated in float32).
In float32 every cast is a no-op and the gradient is autodiff's. Being a custom VJP, it supports
reverse-mode autodiff only (no `jax.jvp` / `jax.jacfwd` through it).
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def f32_einsum(spec: str, a: Float[Array, "..."], b: Float[Array, "..."]) -> Float[Array, "..."]:
    """`jnp.einsum(spec, a, b)` accumulated and returned in float32; the gradients come back in
    the operands' dtype (which must be the same), from matmuls in that dtype."""
    if a.dtype != b.dtype:
        raise TypeError(f"f32_einsum: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    return _f32_einsum(spec, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _f32_einsum(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _fwd(spec, a, b):
    return _f32_einsum(spec, a, b), (a, b)


def _bwd(spec, res, g):
    a, b = res
    _, pullback = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a, b)
    return pullback(g.astype(a.dtype))


_f32_einsum.defvjp(_fwd, _bwd)
