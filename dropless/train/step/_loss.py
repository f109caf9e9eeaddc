"""The loss a train step minimises, its terms, and the MoE statistics a step reports.

loss = cross-entropy(next token)
     + mtp_loss_weight * mean over depths of the MTP cross-entropies
     + balance_loss_coef * sum over MoE layers of the batch-wise balance loss
     + seq_balance_loss_coef * sum over MoE layers of the sequence-wise balance loss
     + global_balance_loss_coef * sum over MoE layers of the global-batch balance loss
     + z_loss_coef * sum over MoE layers of the router z-loss

The balance losses are values (`dropless.BALANCE_LOSSES`), each weighed by its
`<term>_coef`, with every one's term in the metrics. "MoE layers" are the main stack's and the
MTP blocks'. The weights come as arrays (`dropless.train.step._step.hparams`), so the compiled
step depends only on the model and the batch shape.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dropless._balance_loss import BALANCE_LOSSES, AbstractBalanceLoss
from dropless._moe import MoEStats
from dropless.models.deepseek_v3 import DeepSeekV3, ModelFeatures, ModelOutput, mtp_targets
from dropless.train.step._accumulate import micro_batch_slices
from dropless.train.step._cross_entropy import cross_entropy, head_cross_entropy


def all_moe_stats(out: ModelOutput | ModelFeatures) -> MoEStats:
    """The statistics of every MoE layer: the main stack's rows, then the MTP blocks'."""
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out.moe_stats, out.mtp_moe_stats)


def loss_terms(
    model: DeepSeekV3, tokens: Int[Array, "batch window"]
) -> tuple[dict[str, Float[Array, ""]], ModelOutput | ModelFeatures]:
    """Unweighted loss terms of `model` on a batch of windows (inputs `tokens[:, :-1]`, targets
    `tokens[:, 1:]`), and the model's output (its features when `config.loss_chunk` is set: the
    loss then makes the logits chunk by chunk, `head_cross_entropy`).

    `mtp` is the mean over depths of each depth's cross-entropy on its valid positions (see
    `dropless.models.deepseek_v3.mtp_targets`); the balance terms are sums over every MoE layer.
    """
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    chunk = model.config.loss_chunk
    if chunk is None:
        out = model(inputs)
        main, mtp, loss = out.logits, out.mtp_logits, cross_entropy
    else:  # the logits are made inside the loss, chunk by chunk
        out = model.features(inputs)
        w = model.head_weight().astype(out.hidden.dtype)
        main, mtp = out.hidden, out.mtp_hidden

        def loss(hidden, targets, mask=None):
            with jax.named_scope("head"):
                return head_cross_entropy(
                    hidden,
                    w,
                    targets,
                    mask,
                    chunk=chunk,
                    logits_dtype=model.config.logits_jnp_dtype,
                )

    terms = {"ce": loss(main, labels)}
    if mtp is not None:
        depth = mtp.shape[0]
        targets, masks = mtp_targets(labels, depth)
        per_depth = [loss(mtp[d], targets[d], masks[d]) for d in range(depth)]
        terms["mtp"] = jnp.mean(jnp.stack(per_depth))
    else:
        terms["mtp"] = jnp.zeros((), jnp.float32)
    stats = all_moe_stats(out)
    for kind in BALANCE_LOSSES:
        if not kind.whole_batch:  # `weighted_loss` adds the others, once it has the loads
            terms[kind.term] = kind()(stats).sum()
    terms["z_loss"] = stats.z_loss.sum()
    return terms, out


def balance_losses(weights: dict[str, Float[Array, ""]]) -> tuple[AbstractBalanceLoss, ...]:
    """Every balance loss, with its coefficient from `weights` (`hparams`: data; 0 is off)."""
    return tuple(kind(coef=weights[f"{kind.term}_coef"]) for kind in BALANCE_LOSSES)


def total_loss(
    terms: dict[str, Float[Array, ""]], weights: dict[str, Float[Array, ""]]
) -> Float[Array, ""]:
    """The weighted sum of the loss terms that the optimiser minimises (`weights`: `hparams`);
    a balance term not yet in `terms` (a whole-batch one before `weighted_loss`) adds 0."""
    loss = terms["ce"] + weights["mtp_loss_weight"] * terms["mtp"]
    for balance_loss in balance_losses(weights):
        loss = loss + balance_loss.coef * terms.get(balance_loss.term, 0.0)
    return loss + weights["z_loss_coef"] * terms["z_loss"]


def stats_metrics(out: ModelOutput) -> dict[str, Array]:
    stats = all_moe_stats(out)
    max_vio = stats.max_vio
    return {
        "max_vio": max_vio.mean() if max_vio.size else jnp.zeros(()),
        "max_vio_layers": max_vio,
        "tokens_per_expert": stats.tokens_per_expert,
        "dropped": stats.dropped.sum(),
        "router_entropy": stats.router_entropy.mean() if max_vio.size else jnp.zeros(()),
        "unused_experts": jnp.sum(stats.tokens_per_expert == 0),
        "active_experts": stats.active_experts.mean() if max_vio.size else jnp.zeros(()),
    }


def weighted_loss(
    model: DeepSeekV3,
    tokens: Int[Array, "batch window"],
    weights: dict[str, Float[Array, ""]],
    loads: Float[Array, "layers experts"] | None = None,
    *,
    gather: Callable[[Array], Array] | None = None,
) -> tuple[Float[Array, ""], tuple[dict[str, Float[Array, ""]], tuple[MoEStats, MoEStats]]]:
    """The loss the optimiser minimises, with (its terms, the MoE statistics of the main stack
    and of the MTP blocks): what `accumulated` sums over micro-batches.

    The whole-batch balance losses (the global-batch one) take their load fractions from
    `loads` (tokens per expert of the whole step's batch, every MoE layer: `batch_loads`), or
    without them from this batch's own loads passed through `gather` (on a mesh: summed over
    the data shards)."""
    terms, out = loss_terms(model, tokens)
    stats = all_moe_stats(out)
    if loads is None:
        loads = stats.tokens_per_expert if gather is None else gather(stats.tokens_per_expert)
    for kind in BALANCE_LOSSES:
        if kind.whole_batch:
            terms[kind.term] = kind()(stats, loads).sum()
    return total_loss(terms, weights), (terms, (out.moe_stats, out.mtp_moe_stats))


def batch_loads(
    model: DeepSeekV3, tokens: Int[Array, "batch window"], micro_batches: int = 1
) -> Float[Array, "layers experts"]:
    """Tokens per expert of every MoE layer over the whole batch (no gradient), a forward pass
    without the vocabulary head in `micro_batches` slices: the global-batch balance loss's
    loads when the step runs in slices."""

    def loads(model, micro):
        return all_moe_stats(model.features(micro[:, :-1])).tokens_per_expert

    slices = micro_batch_slices(tokens, micro_batches)

    def add(total, micro):
        return total + loads(model, micro), None

    zeros = jax.eval_shape(loads, model, slices[0])
    total, _ = jax.lax.scan(add, jnp.zeros(zeros.shape, zeros.dtype), slices)
    return total


def loads_only(stats: tuple[MoEStats, MoEStats]) -> ModelOutput:
    """A ModelOutput carrying only the MoE statistics of the main stack and the MTP blocks: all
    that the bias update and the step's metrics read."""
    return ModelOutput(jnp.zeros((0, 0, 0)), None, *stats)
