"""Next-token cross-entropy: one pass over the float32 logits forward, softmax minus one-hot
backward (a custom VJP, so reverse-mode autodiff only: no `jax.jvp` or `jax.jacfwd` through
it)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Float32, Int


def cross_entropy(
    logits: Float[Array, "batch seq vocab"],
    targets: Int[Array, "batch seq"],
    mask: Bool[Array, "batch seq"] | None = None,
) -> Float[Array, ""]:
    """Mean cross-entropy of `targets` under `logits` (computed in float32), over the
    positions where `mask` is True (all when None)."""
    ce = token_cross_entropy(logits.astype(jnp.float32), targets)
    if mask is None:
        return ce.mean()
    return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(mask.sum(), 1)


def _is_target(logits, targets):
    # The target picked by a one-hot mask, not a gather: the gradient is one elementwise
    # expression (softmax minus one-hot) that XLA fuses with its cast to the head's bf16, where
    # a gather's transpose is a scatter into a float32 [batch seq vocab] buffer
    # (docs/benchmarks.md, twelfth run).
    return jnp.arange(logits.shape[-1]) == targets[..., None]


@jax.custom_vjp
def token_cross_entropy(
    logits: Float32[Array, "batch seq vocab"], targets: Int[Array, "batch seq"]
) -> Float32[Array, "batch seq"]:
    """logsumexp(logits) - logits[target] per position, from float32 logits in one reduction
    over the vocabulary (running maximum, rescaled sum of exponentials, target logit). The
    backward keeps the logits and the logsumexp. A +inf logit gives nan (optax: inf)."""
    # One pass where `jax.nn.logsumexp` and the target's pick are three reductions. JAX
    # cannot differentiate such a reduction, hence the custom VJP.
    return _forward(logits, targets)[0]


def _combine(a, b):
    (max_a, sum_a, target_a), (max_b, sum_b, target_b) = a, b
    top = jnp.maximum(max_a, max_b)
    rescaled = sum_a * jnp.exp(max_a - top) + sum_b * jnp.exp(max_b - top)
    return top, rescaled, target_a + target_b


def _forward(logits, targets):
    # Each element enters as (its value, a sum of one, its value if it is the target's).
    # The initial maximum is the lowest finite float32, not -inf: with two -inf maxima,
    # max - top would be nan.
    lowest = jnp.finfo(jnp.float32).min
    init = (jnp.float32(lowest), jnp.float32(0), jnp.float32(0))
    picked = jnp.where(_is_target(logits, targets), logits, 0.0)
    top, total, target_logits = jax.lax.reduce(
        (logits, jnp.ones_like(logits), picked), init, _combine, (logits.ndim - 1,)
    )
    lse = top + jnp.log(total)
    return lse - target_logits, (logits, targets, lse)


def _backward(residuals, d_ce):
    logits, targets, lse = residuals
    softmax = jnp.exp(logits - lse[..., None])
    d_logits = (softmax - _is_target(logits, targets)) * d_ce[..., None]
    return d_logits, None


token_cross_entropy.defvjp(_forward, _backward)
