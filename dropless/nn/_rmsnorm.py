"""Root-mean-square layer normalisation."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


class RMSNorm(eqx.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), over the last axis.

    Statistics are computed in float32 whatever the input dtype (bf16 sums of squares lose too
    much); the result comes back in the input's dtype, as in Hugging Face DeepSeek-V3.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight.astype(jnp.float32) * normed).astype(x.dtype)
