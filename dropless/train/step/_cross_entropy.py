"""Next-token cross-entropy: float32 reductions over the logits forward (float32 or bfloat16
logits, converted as they are read; one pass on GPUs, two on the CPU), softmax minus one-hot
backward (a custom VJP, so reverse-mode autodiff only: no `jax.jvp` or `jax.jacfwd` through
it). `head_cross_entropy` makes the logits itself from the hidden states, chunk by chunk, with
their gradients, so that the whole `[batch seq vocab]` logits never exist at once."""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Float32, Int


def cross_entropy(
    logits: Float[Array, "batch seq vocab"],
    targets: Int[Array, "batch seq"],
    mask: Bool[Array, "batch seq"] | None = None,
) -> Float[Array, ""]:
    """Mean cross-entropy of `targets` under `logits` (computed in float32 whatever their
    dtype), over the positions where `mask` is True (all when None)."""
    ce = token_cross_entropy(logits, targets)
    if mask is None:
        return ce.mean()
    return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(mask.sum(), 1)


def _is_target(logits, targets):
    # The target picked by a one-hot mask, not a gather: the gradient is one elementwise
    # expression (softmax minus one-hot) that XLA fuses with its cast to the head's bf16, where
    # a gather's transpose is a scatter into a float32 [batch seq vocab] buffer.
    return jnp.arange(logits.shape[-1]) == targets[..., None]


@jax.custom_vjp
def token_cross_entropy(
    logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"]
) -> Float32[Array, "batch seq"]:
    """logsumexp(logits) - logits[target] per position, in float32. On GPUs (and any platform
    but the CPU) one reduction over the vocabulary (running maximum, rescaled sum of
    exponentials, target logit); on the CPU two (the maximum, then the sums), which XLA's CPU
    code runs faster. The backward keeps the logits as they came (bfloat16 logits: half the
    bytes to store and read again) and the logsumexp; the gradient has the logits' dtype. A
    +inf logit gives inf, or nan where it is the target's, as in optax."""
    # JAX cannot differentiate a reduction with a custom combiner, hence the custom VJP.
    return _forward(logits, targets)[0]


def _forward(logits, targets):
    # Measured per platform (benchmarks/bench_cross_entropy.py). H100, 49152 x 32768 logits:
    # the one pass's forward takes 2.2 ms where two take 4.2 (float32) and 2.2 (bf16). 2-core
    # CPU, float32: two passes are 3-5x faster than one.
    lse, target_logits = jax.lax.platform_dependent(
        logits, targets, cpu=_logsumexp_two_passes, default=_logsumexp_one_pass
    )
    return lse - target_logits, (logits, targets, lse)


def _logsumexp_one_pass(logits, targets, combine=None):
    """(logsumexp, target logit) per position in one variadic reduction, whose combiner is
    `_combine` unless `combine` is given (benchmarks/bench_cross_entropy.py times others)."""
    # Each element enters as (its value, a sum of one, its value if it is the target's).
    # The initial maximum is the lowest finite float32, not -inf (see `_combine`).
    lowest = jnp.finfo(jnp.float32).min
    init = (jnp.float32(lowest), jnp.float32(0), jnp.float32(0))
    wide = logits.astype(jnp.float32)  # fused into the reduction: read once, in any dtype
    picked = jnp.where(_is_target(logits, targets), wide, 0.0)
    top, total, target_logits = jax.lax.reduce(
        (wide, jnp.ones_like(wide), picked), init, combine or _combine, (logits.ndim - 1,)
    )
    return top + jnp.log(total), target_logits


def _combine(a, b):
    """Two (maximum, sum of exp(x - maximum), target logit) into one, with one exponential:
    the sum under the smaller maximum is scaled by exp(smaller - larger). Equal maxima (two
    -inf ones too, which would give exp(nan)) just add their sums."""
    (max_a, sum_a, target_a), (max_b, sum_b, target_b) = a, b
    scale = jnp.where(max_a == max_b, 1.0, jnp.exp(-jnp.abs(max_a - max_b)))
    total = jnp.where(max_a >= max_b, sum_a + sum_b * scale, sum_a * scale + sum_b)
    return jnp.maximum(max_a, max_b), total, target_a + target_b


def _logsumexp_two_passes(logits, targets):
    """(logsumexp, target logit) per position: the maximum, then the sum of exponentials and
    the target's pick (two sums over the row, which XLA may fuse into one pass)."""
    wide = logits.astype(jnp.float32)
    top = jnp.max(wide, axis=-1)
    safe_top = jnp.where(jnp.isfinite(top), top, 0.0)  # a row of -inf: log(0) = -inf, as optax
    total = jnp.sum(jnp.exp(wide - safe_top[..., None]), axis=-1)
    target_logits = jnp.sum(jnp.where(_is_target(logits, targets), wide, 0.0), axis=-1)
    return safe_top + jnp.log(total), target_logits


def _backward(residuals, d_ce):
    logits, targets, lse = residuals
    softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    d_logits = (softmax - _is_target(logits, targets)) * d_ce[..., None]
    return d_logits.astype(logits.dtype), None


token_cross_entropy.defvjp(_forward, _backward)


def head_cross_entropy(
    hidden: Float[Array, "batch seq dim"],
    w: Float[Array, "dim vocab"],
    targets: Int[Array, "batch seq"],
    mask: Bool[Array, "batch seq"] | None = None,
    *,
    chunk: int,
    logits_dtype=jnp.float32,
) -> Float[Array, ""]:
    """`cross_entropy(hidden @ w, targets, mask)` (logits in `logits_dtype` from `hidden`'s
    dtype, as the model's head makes them), `chunk` positions at a time: each chunk's logits
    are made, reduced and turned into their gradient (softmax minus one-hot) in one go, and
    only the gradients of `hidden` and `w` are kept for the backward. Memory: one chunk's
    logits where the plain loss holds all of them and their gradient. `w` must have `hidden`'s
    dtype."""
    if w.dtype != hidden.dtype:
        raise TypeError(f"head_cross_entropy: w is {w.dtype}, hidden is {hidden.dtype}")
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"head_cross_entropy: chunk ({chunk!r}) must be an int >= 1")
    dim = hidden.shape[-1]
    flat_h, flat_t = hidden.reshape(-1, dim), targets.reshape(-1)
    if mask is None:
        weights = jnp.full(flat_t.shape, 1.0 / flat_t.size, jnp.float32)
    else:
        weights = mask.reshape(-1).astype(jnp.float32) / jnp.maximum(mask.sum(), 1)
    pad = -flat_t.size % chunk  # padded positions weigh 0
    flat_h = jnp.pad(flat_h, ((0, pad), (0, 0)))
    flat_t, weights = jnp.pad(flat_t, (0, pad)), jnp.pad(weights, (0, pad))
    return _weighted_head_ce(flat_h, w, flat_t, weights, chunk, jnp.dtype(logits_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _weighted_head_ce(hidden, w, targets, weights, chunk, logits_dtype):
    return _chunks(hidden, w, targets, weights, chunk, logits_dtype, with_grads=False)[0]


def _chunks(hidden, w, targets, weights, chunk, logits_dtype, *, with_grads):
    """sum of weights * CE over the chunks; with_grads: also each position's CE (the weights'
    gradient), d/d hidden in hidden's dtype and d/d w in float32."""

    def body(dw, xs):
        h, t, weight = xs
        logits = jnp.einsum("nd,dv->nv", h, w, preferred_element_type=logits_dtype)
        ce, (_, _, lse) = _forward(logits, t)
        loss = jnp.sum(ce * weight)
        if not with_grads:
            return dw, (loss, None, None)
        g = _backward((logits, t, lse), weight)[0].astype(h.dtype)
        dh = jnp.einsum("nv,dv->nd", g, w, preferred_element_type=jnp.float32).astype(h.dtype)
        dw = dw + jnp.einsum("nd,nv->dv", h, g, preferred_element_type=jnp.float32)
        return dw, (loss, ce, dh)

    def split(x):
        return x.reshape(-1, chunk, *x.shape[1:])

    dw = jnp.zeros(w.shape, jnp.float32) if with_grads else None
    dw, (losses, ce, dh) = jax.lax.scan(body, dw, (split(hidden), split(targets), split(weights)))
    loss = losses.sum()
    if not with_grads:
        return loss, None
    return loss, (dh.reshape(hidden.shape), dw, ce.reshape(-1))


def _head_ce_fwd(hidden, w, targets, weights, chunk, logits_dtype):
    return _chunks(hidden, w, targets, weights, chunk, logits_dtype, with_grads=True)


def _head_ce_bwd(chunk, logits_dtype, residuals, d_loss):
    dh, dw, ce = residuals
    return (
        (dh * d_loss).astype(dh.dtype),
        (dw * d_loss).astype(dh.dtype),
        None,
        ce * d_loss,
    )


_weighted_head_ce.defvjp(_head_ce_fwd, _head_ce_bwd)
