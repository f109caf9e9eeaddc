"""Load balancing: auxiliary losses, routing statistics and the aux-loss-free bias update."""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Real

from dropless._bias_update import SignBiasUpdate
from dropless._routing import Routing


def expert_counts(expert_ids: Int[Array, "*copies"], n_experts: int) -> Int[Array, " experts"]:
    """How many copies each expert receives, in int32; ids outside [0, n_experts) count for
    no expert.

    Lowered for the CPU, a bincount (scatter-add); elsewhere each id is compared with every
    expert and summed, one fused reduction of copies x experts, since on a GPU the scatter's
    atomic adds into a few bins serialise (H200, 98,304 copies into 64 experts: 29.5 us per
    count against 3.7). The dispatcher's group sizes and the routing statistics both count
    through here, so XLA can compute the count once per layer.
    """
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    return jax.lax.platform_dependent(
        flat,
        cpu=functools.partial(_count_by_scatter, n_experts=n_experts),
        default=functools.partial(_count_by_compare, n_experts=n_experts),
    )


def _count_by_scatter(ids: Int[Array, " copies"], n_experts: int) -> Int[Array, " experts"]:
    # bincount clips negative ids to 0; sent past the end, they are dropped like the others
    ids = jnp.where(ids < 0, n_experts, ids)
    return jnp.bincount(ids, length=n_experts).astype(jnp.int32)


def _count_by_compare(ids: Int[Array, " copies"], n_experts: int) -> Int[Array, " experts"]:
    return (ids[:, None] == jnp.arange(n_experts, dtype=jnp.int32)).sum(0, dtype=jnp.int32)


def tokens_per_expert(
    expert_ids: Int[Array, "tokens k"], n_experts: int
) -> Float[Array, " experts"]:
    """How many (token, expert) copies each expert receives."""
    return expert_counts(expert_ids, n_experts).astype(jnp.float32)


def max_violation(counts: Float[Array, " experts"]) -> Float[Array, ""]:
    """MaxVio: max load over mean load, minus one (0 for perfect balance)."""
    return counts.max() / jnp.maximum(counts.mean(), 1e-9) - 1.0


def _normalised_scores(scores: Float[Array, "tokens experts"]) -> Float[Array, "tokens experts"]:
    # Sigmoid scores do not sum to one; DeepSeek-V3 normalises them per token for the loss.
    return scores / (scores.sum(-1, keepdims=True) + 1e-20)


def router_probability(scores: Float[Array, "tokens experts"]) -> Float[Array, " experts"]:
    """P_i of the balance losses: the mean over tokens of each expert's normalised score."""
    return _normalised_scores(scores).mean(0)


def batch_balance_loss(routing: Routing) -> Float[Array, ""]:
    """Switch-Transformer load-balancing loss over the whole batch: E * sum_i f_i * P_i.

    f_i is the fraction of copies sent to expert i, P_i the mean normalised score; 1 when balanced.
    """
    n_experts = routing.scores.shape[-1]
    counts = tokens_per_expert(routing.expert_ids, n_experts)
    return global_balance_loss(router_probability(routing.scores), counts)


def global_balance_loss(
    probability: Float[Array, "*layers experts"], counts: Float[Array, "*layers experts"]
) -> Float[Array, "*layers"]:
    """The batch-wise loss E * sum_i f_i * P_i from its two halves: `probability` P (this
    slice's `router_probability`, differentiable) and `counts`, the copies per expert of a
    larger batch (summed over data shards and micro-batches: Qwen's global-batch balancing),
    whose fractions f carry no gradient. The mean of this over equal slices is the loss of the
    whole batch, as the mean of their P is the whole batch's P."""
    counts = jax.lax.stop_gradient(counts).astype(jnp.float32)
    f = counts / jnp.maximum(counts.sum(-1, keepdims=True), 1.0)
    return probability.shape[-1] * jnp.sum(f * probability, -1)


def sequence_balance_loss(routing: Routing, seq_len: int) -> Float[Array, ""]:
    """DeepSeek-V3's sequence-wise balance loss: the batch loss within each sequence, averaged.

    Tokens are taken in order as consecutive sequences of `seq_len` positions.
    """
    tokens, n_experts = routing.scores.shape
    if tokens % seq_len:
        raise ValueError(f"seq_len ({seq_len}) must divide the number of tokens ({tokens})")
    k = routing.expert_ids.shape[-1]
    ids = routing.expert_ids.reshape(-1, seq_len, k)
    one_hot = jax.nn.one_hot(ids, n_experts, dtype=jnp.float32).sum(2)  # [seqs seq experts]
    f = one_hot.sum(1) * n_experts / (k * seq_len)
    p = _normalised_scores(routing.scores).reshape(-1, seq_len, n_experts).mean(1)
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, -1))


def router_z_loss(logits: Float[Array, "tokens experts"]) -> Float[Array, ""]:
    """ST-MoE router z-loss: mean squared log-partition of the router logits."""
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def router_entropy(scores: Float[Array, "tokens experts"]) -> Float[Array, ""]:
    """Mean over tokens of the entropy (nats) of each token's normalised scores: log(experts)
    for a router that cannot tell experts apart, 0 for one that puts all weight on one."""
    p = _normalised_scores(scores)
    return -jnp.mean(jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), -1))


def coselection(
    expert_ids: Int[Array, "tokens k"], n_experts: int
) -> Int[Array, "experts experts"]:
    """c[i, j]: tokens that chose both expert i and expert j (the diagonal: tokens that chose
    i). Pairs chosen together far more often than chance are experts that act as one."""
    one_hot = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.int32).sum(1)  # [tokens experts]
    return jnp.einsum("te,tf->ef", one_hot, one_hot, preferred_element_type=jnp.int32)


def dead_experts(loads: Real[Array, "steps *layers experts"]) -> Int[Array, "*layers"]:
    """Experts that no token chose in any of the `steps` loads (per layer)."""
    return jnp.sum(jnp.all(loads == 0, axis=0), axis=-1)


def update_expert_bias(
    bias: Float[Array, "*layers experts"],
    tokens_per_expert: Float[Array, "*layers experts"],
    rate: float | Float[Array, ""],
) -> Float[Array, "*layers experts"]:
    """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower the
    bias of over-loaded ones, by `rate` each step (`SignBiasUpdate`; `dropless._bias_update` has
    the other rules). Works on stacked layers too; never a gradient."""
    return SignBiasUpdate()(bias, tokens_per_expert, rate)
