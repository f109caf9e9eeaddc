"""Contractions that return float32 from low-precision inputs, with a backward in their dtype.

`jnp.einsum(..., preferred_element_type=float32)` is the way to ask for float32 results from
bf16 operands (cuBLAS accumulates in float32 either way). Autodiff's transpose of it, though,
contracts the float32 cotangent with the bf16 operands, so XLA upcasts them and both backward
matmuls run in float32: on an H200 that is TF32 speed at best, several times slower than bf16.
`f32_einsum` rounds the cotangent to the operands' dtype first, as mixed-precision training
does everywhere else, so the backward matmuls run in that dtype (still accumulated in float32).
In float32 every cast is a no-op and the gradient is autodiff's. Being a custom VJP, it supports
reverse-mode autodiff only (no `jax.jvp` / `jax.jacfwd` through it).

`cast_for_compute` is a cast whose gradient is materialised in the compute dtype before it is
cast back, for weight stacks used only in that dtype (see its docstring).

`apply_updates` adds optimiser updates to parameters and keeps each parameter's dtype.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree


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


def cast_for_compute(x: Float[Array, "..."], dtype) -> Float[Array, "..."]:
    """`x.astype(dtype)` for a weight used only in `dtype`, whose gradient is materialised in
    `dtype` (an optimisation barrier) and only then cast to x's dtype. Applied to a stack of
    layer weights, the per-layer gradients are then concatenated in `dtype` (bf16: half the
    bytes of float32) into one plain buffer, and the cast back fuses into the optimiser's
    readers (the global norm, AdamW); without the barrier XLA fuses the concatenation itself
    into each of those readers, a slow kernel on a GPU (proxy-2b on an H200: 0.155 s a step
    with the barrier, 0.177 s without, benchmarks/results/train_step_h200_history.json). The
    values are a plain cast's: a bf16 gradient cast to float32 is exact. With `dtype` equal to
    x's it is the identity with the barrier on the gradient."""
    return _cast_for_compute(x, jnp.dtype(dtype), x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _cast_for_compute(x, dtype, source_dtype):
    return x.astype(dtype)


def _cast_fwd(x, dtype, source_dtype):
    return x.astype(dtype), None


def _cast_bwd(dtype, source_dtype, _, g):
    return (jax.lax.optimization_barrier(g.astype(dtype)).astype(source_dtype),)


_cast_for_compute.defvjp(_cast_fwd, _cast_bwd)


def apply_updates(model: PyTree, updates: PyTree) -> PyTree:
    """`model + updates` where an update is not None, each sum in its parameter's dtype.

    `eqx.apply_updates` returns `p + u` as promoted: a bfloat16 parameter with AdamW's float32
    update comes back float32, so a `param_dtype="bfloat16"` model would silently train in
    float32 after its first step (and a checkpoint restored into bfloat16 would differ)."""

    def add(update, param):
        return param if update is None else (param + update).astype(param.dtype)

    return jax.tree.map(add, updates, model, is_leaf=lambda x: x is None)
