"""The dropless Mixture-of-Experts layer: route -> dispatch -> experts -> combine (+ shared)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from dropless import balance
from dropless.backends.chunked import ChunkedGroupedMatmul
from dropless.backends.sort import SortDispatcher
from dropless.dispatch import AbstractDispatcher, require_row_weights
from dropless.experts import AbstractGroupedMatmul, GroupedExperts
from dropless.routing import AbstractTopK, JnpTopK, Routing, RoutingSpec, TopKRouter
from dropless.swiglu import SwiGLU


class MoEStats(eqx.Module):
    """What one MoE call reports besides its output. Losses are unweighted; the trainer weighs.

    `expert_ids` and `weights` (each token's experts and their weights, `Routing`'s) are there
    only when asked for (`return_routing=True`); None otherwise, and then they cost nothing.
    """

    tokens_per_expert: Float[Array, " experts"]
    max_vio: Float[Array, ""]
    balance_loss: Float[Array, ""]  # Switch-style, over the whole batch
    seq_balance_loss: Float[Array, ""]  # DeepSeek-V3 sequence-wise
    z_loss: Float[Array, ""]
    dropped: Float[Array, ""]  # copies not computed (always 0 unless an EP buffer overflowed)
    expert_ids: Int[Array, "tokens k"] | None = None
    weights: Float[Array, "tokens k"] | None = None


def with_loads(
    stats: MoEStats,
    tokens_per_expert: Float[Array, "layers experts"],
    dropped: Float[Array, " layers"],
) -> MoEStats:
    """`stats`, stacked over layers, with these loads and drops (of a larger batch: summed over
    devices or micro-batches) and MaxVio recomputed from them, layer by layer."""
    if tokens_per_expert.shape[0]:
        max_vio = jax.vmap(balance.max_violation)(tokens_per_expert)
    else:
        max_vio = stats.max_vio  # no layers
    # tree_at, not MoEStats(...): the fields are stacked over layers
    return eqx.tree_at(
        lambda s: (s.tokens_per_expert, s.max_vio, s.dropped),
        stats,
        (tokens_per_expert, max_vio, dropped),
    )


def routing_stats(
    routing: Routing,
    seq_len: int | None = None,
    dropped: Float[Array, ""] | None = None,
    *,
    return_routing: bool = False,
) -> MoEStats:
    """Statistics and auxiliary losses of one routing decision (and, with `return_routing`,
    its expert ids and weights)."""
    tokens, n_experts = routing.scores.shape
    counts = balance.tokens_per_expert(routing.expert_ids, n_experts)
    return MoEStats(
        tokens_per_expert=counts,
        max_vio=balance.max_violation(counts),
        balance_loss=balance.batch_balance_loss(routing),
        seq_balance_loss=balance.sequence_balance_loss(routing, seq_len or tokens),
        z_loss=balance.router_z_loss(routing.logits),
        dropped=jnp.zeros((), jnp.float32) if dropped is None else dropped.astype(jnp.float32),
        expert_ids=routing.expert_ids if return_routing else None,
        weights=routing.weights if return_routing else None,
    )


class MoE(eqx.Module):
    """DeepSeekMoE layer on flat tokens: routed experts (dropless) plus optional shared experts.

    The strategies are values: `topk` (the router's top-k), `dispatcher` and `gmm` (the experts'
    grouped matmul), by default the portable jnp ones. `dropless.with_backend` swaps them in a
    built model without touching any array.

    `weights_before_down`: each copy's routing weight scales its hidden units, before the
    experts' down projection, and the combine only sums. The same function (the projection is
    linear); the combine's backward then needs no expert outputs, so the step neither keeps nor
    reads them, and the weights' gradient comes from the hidden units instead. The dispatcher
    must give row weights (an `AbstractRowWeightsDispatcher`, such as `SortDispatcher`).

    `experts_bias`, `swiglu_limit`, `swiglu_alpha`: the routed experts' biases and clamped SwiGLU
    (gpt-oss; `GroupedExperts`).
    """

    router: TopKRouter
    experts: GroupedExperts
    shared: SwiGLU | None
    dispatcher: AbstractDispatcher
    weights_before_down: bool = eqx.field(default=False, static=True)

    def __init__(
        self,
        dim: int,
        moe_intermediate_size: int,
        spec: RoutingSpec,
        *,
        n_shared_experts: int = 0,
        dtype=jnp.float32,
        dispatcher: AbstractDispatcher = SortDispatcher(),  # noqa: B008 (immutable)
        gmm: AbstractGroupedMatmul = ChunkedGroupedMatmul(),  # noqa: B008 (immutable)
        topk: AbstractTopK = JnpTopK(),  # noqa: B008 (immutable)
        weights_before_down: bool = False,
        experts_bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
        key: PRNGKeyArray,
    ):
        for name, value, least in (
            ("dim", dim, 1),
            ("moe_intermediate_size", moe_intermediate_size, 1),
            ("n_shared_experts", n_shared_experts, 0),
        ):
            if value < least:
                raise ValueError(f"MoE: {name} ({value}) must be >= {least}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"MoE: dtype ({jnp.dtype(dtype)}) must be a floating-point dtype")
        for name, value, kind in (
            ("dispatcher", dispatcher, AbstractDispatcher),
            ("gmm", gmm, AbstractGroupedMatmul),
            ("topk", topk, AbstractTopK),
        ):
            if not isinstance(value, kind):
                raise TypeError(f"MoE: {name} must be an {kind.__name__}, got {value!r}")
        k_router, k_experts, k_shared = jax.random.split(key, 3)
        self.router = TopKRouter(dim, spec, dtype=dtype, topk=topk, key=k_router)
        self.experts = GroupedExperts(
            spec.n_routed_experts,
            dim,
            moe_intermediate_size,
            gmm=gmm,
            bias=experts_bias,
            swiglu_limit=swiglu_limit,
            swiglu_alpha=swiglu_alpha,
            dtype=dtype,
            key=k_experts,
        )
        self.shared = (
            SwiGLU(dim, moe_intermediate_size * n_shared_experts, dtype=dtype, key=k_shared)
            if n_shared_experts
            else None
        )
        self.dispatcher = dispatcher
        self.weights_before_down = weights_before_down
        if weights_before_down:  # here as well as at the call: say so before any tracing
            require_row_weights(self.dispatcher)
            if not self.experts.plain:
                raise ValueError(
                    "MoE: weights_before_down needs experts without biases or a clamped SwiGLU"
                )

    def __call__(
        self,
        x: Float[Array, "tokens dim"],
        *,
        seq_len: int | None = None,
        return_routing: bool = False,
    ) -> tuple[Float[Array, "tokens dim"], MoEStats]:
        """`seq_len` groups tokens into sequences for the sequence-wise balance loss;
        `return_routing` (a Python bool) puts the routing's `expert_ids` and `weights` in the
        stats."""
        dim = self.router.w_router.shape[1]
        if x.ndim != 2 or x.shape[1] != dim:
            raise ValueError(f"MoE: x must be [tokens dim] with dim = {dim}, got shape {x.shape}")
        if x.shape[0] == 0:
            raise ValueError(f"MoE: x must hold at least one token, got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"MoE: x must be a floating-point array (float32, bfloat16, ...; the router "
                f"computes in float32, the experts in x's dtype), got dtype {x.dtype}"
            )
        if seq_len is not None and seq_len < 1:
            raise ValueError(f"MoE: seq_len ({seq_len}) must be >= 1, or None for one sequence")
        routing = self.router(x)
        dispatched = self.dispatcher.dispatch(x, routing)
        if self.weights_before_down:
            dispatcher = require_row_weights(self.dispatcher)
            row_weights = dispatcher.row_weights(dispatched, routing)
            y_rows = self.experts(dispatched.rows, dispatched.group_sizes, row_weights)
            y = dispatcher.sum_copies(y_rows, dispatched, routing)
        else:
            y_rows = self.experts(dispatched.rows, dispatched.group_sizes)
            y = self.dispatcher.combine(y_rows, dispatched, routing)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, routing_stats(routing, seq_len, dispatched.dropped, return_routing=return_routing)
