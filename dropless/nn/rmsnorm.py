"""Root-mean-square layer normalisation."""

import functools

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
        return rms_norm(x, self.weight, self.eps)


def _inverse_rms(x32: Float[Array, "*batch dim"], eps: float) -> Float[Array, "*batch 1"]:
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(
    x: Float[Array, "*batch dim"], weight: Float[Array, " dim"], eps: float
) -> Float[Array, "*batch dim"]:
    """`RMSNorm`'s function. Its backward keeps only x (as it came) and one float32 number per
    row: autodiff would keep x in float32 and the normalised x too, two float32 copies of the
    activations per norm (about 4 GiB a step in proxy-2b at batch 8)."""
    x32 = x.astype(jnp.float32)
    return (weight.astype(jnp.float32) * x32 * _inverse_rms(x32, eps)).astype(x.dtype)


def _rms_norm_fwd(x, weight, eps):
    x32 = x.astype(jnp.float32)
    inverse_rms = _inverse_rms(x32, eps)
    y = (weight.astype(jnp.float32) * x32 * inverse_rms).astype(x.dtype)
    return y, (x, weight, inverse_rms)


def _rms_norm_bwd(eps, residuals, dy):
    del eps
    x, weight, inverse_rms = residuals
    normed = x.astype(jnp.float32) * inverse_rms
    dy32 = dy.astype(jnp.float32)
    d_weight = jnp.sum(dy32 * normed, axis=tuple(range(dy.ndim - 1)))
    d_normed = dy32 * weight.astype(jnp.float32)
    # d/dx of x * r(x), r = mean(x^2)^(-1/2): r * (d - normed * mean(d * normed)).
    dx = inverse_rms * (d_normed - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True))
    return dx.astype(x.dtype), d_weight.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
