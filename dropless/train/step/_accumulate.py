"""Gradient accumulation: one optimiser step over a batch computed as `micro_batches` passes over
equal slices of it, one after another, so that a batch too large for one pass still trains.

Every loss term is a mean over its slice's tokens (or sequences) and the slices are equal, so
the mean over slices is the whole batch's, with one exception: the batch-wise (Switch) balance
loss is taken per slice. The MoE loads are summed over the slices, so the expert-bias update and
MaxVio see the whole batch.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from dropless._moe import MoEStats, with_loads


def micro_batch_slices(
    tokens: Int[Array, "batch window"], micro_batches: int
) -> Int[Array, "micro_batches slice window"]:
    """`tokens` as `micro_batches` equal slices; slice i holds rows i, i + m, i + 2m, ... Strided,
    so that a batch split over devices by rows is split the same way in every slice."""
    batch = tokens.shape[0]
    if micro_batches < 1 or batch % micro_batches:
        raise ValueError(
            f"micro_batches={micro_batches} must be >= 1 and divide the batch size {batch}"
        )
    return tokens.reshape(batch // micro_batches, micro_batches, *tokens.shape[1:]).swapaxes(0, 1)


def accumulated(
    value_and_grad: Callable, micro_batches: int, *, grad_dtype: str = "float32"
) -> Callable:
    """`value_and_grad(params, tokens) -> ((loss, (terms, stats)), grads)`, with `stats` a tuple
    of stacked `MoEStats`, run over `micro_batches` slices of `tokens` (`jax.lax.scan`): loss,
    terms and gradients averaged over the slices (summed in float32; the gradients in
    `grad_dtype` where it is narrower than theirs: "bfloat16" halves the running sum's
    memory), the statistics merged by `merged_stats`. With one micro-batch, `value_and_grad`
    itself."""
    if micro_batches == 1:
        return value_and_grad

    def run(params, tokens):
        slices = micro_batch_slices(tokens, micro_batches)
        shapes = jax.eval_shape(value_and_grad, params, slices[0])
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, _sum_dtype(s.dtype)), shapes)
        grad_zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, _grad_sum_dtype(s.dtype, grad_dtype)), shapes[1]
        )
        zeros = (zeros[0], grad_zeros)

        def add_slice(total, micro):
            out = value_and_grad(params, micro)
            return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, out), None

        total, _ = jax.lax.scan(add_slice, zeros, slices)
        (loss, (terms, summed_stats)), grads = total
        (loss_like, (terms_like, _)), grads_like = shapes
        loss, terms, grads = jax.tree.map(
            lambda t, s: (t / micro_batches).astype(s.dtype),
            (loss, terms, grads),
            (loss_like, terms_like, grads_like),
        )
        stats = tuple(merged_stats(s, micro_batches) for s in summed_stats)
        return (loss, (terms, stats)), grads

    return run


def merged_stats(summed: MoEStats, micro_batches: int) -> MoEStats:
    """Statistics of `micro_batches` slices, from their field-by-field sum (fields stacked over
    layers): loads and drops summed, MaxVio recomputed per layer from the summed loads, the
    losses, router probabilities and entropies averaged."""
    stats = with_loads(summed, summed.tokens_per_expert, summed.dropped)
    means = (
        stats.balance_loss,
        stats.seq_balance_loss,
        stats.z_loss,
        stats.router_probability,
        stats.router_entropy,
        stats.active_experts,
    )
    # tree_at, not MoEStats(...): the fields are stacked over layers
    return eqx.tree_at(
        lambda s: (
            s.balance_loss,
            s.seq_balance_loss,
            s.z_loss,
            s.router_probability,
            s.router_entropy,
            s.active_experts,
        ),
        stats,
        tuple(mean / micro_batches for mean in means),
    )


def _grad_sum_dtype(dtype, grad_dtype: str):
    if not jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    wide, narrow = _sum_dtype(dtype), jnp.dtype(grad_dtype)
    return narrow if jnp.finfo(narrow).bits < jnp.finfo(wide).bits else wide


def _sum_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.inexact) else dtype
