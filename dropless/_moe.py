"""The dropless Mixture-of-Experts layer: route -> dispatch -> experts -> combine (+ shared)."""

import dataclasses
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from dropless import _balance as balance
from dropless._bias_update import AbstractBiasUpdate, SignBiasUpdate
from dropless._dispatch import AbstractDispatcher, require_row_weights
from dropless._experts import AbstractGroupedMatmul, GroupedExperts
from dropless._routing import AbstractTopK, JnpTopK, Routing, RoutingSpec, TopKRouter
from dropless._swiglu import SwiGLU
from dropless.backends._chunked import ChunkedGroupedMatmul
from dropless.backends._sort import SortDispatcher


class MoEStats(eqx.Module):
    """What one MoE call reports besides its output. Losses are unweighted; the trainer weighs.

    `expert_ids` and `weights` (each token's experts and their weights, `Routing`'s) are there
    only when asked for (`return_routing=True`); None otherwise, and then they cost nothing.
    With zero-computation experts, `tokens_per_expert`, MaxVio and the balance losses are those
    of the computing experts; ids from `experts` on are zero-computation ones.
    """

    tokens_per_expert: Float[Array, " experts"]
    max_vio: Float[Array, ""]
    balance_loss: Float[Array, ""]  # Switch-style, over the whole batch
    seq_balance_loss: Float[Array, ""]  # DeepSeek-V3 sequence-wise
    z_loss: Float[Array, ""]
    dropped: Float[Array, ""]  # copies not computed (always 0 unless an EP buffer overflowed)
    router_probability: Float[Array, " experts"]  # P of the balance losses (differentiable)
    router_entropy: Float[Array, ""]  # mean entropy of each token's normalised scores (nats)
    zero_tokens: Float[Array, " zero"]  # copies each zero-computation expert took ([0]: none)
    active_experts: Float[Array, ""]  # mean computing (not zero-computation) experts per token
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
    n_zero_experts: int = 0,
) -> MoEStats:
    """Statistics and auxiliary losses of one routing decision (and, with `return_routing`,
    its expert ids and weights). The last `n_zero_experts` of its experts compute nothing: the
    losses and loads are the computing experts' (`computing_part`)."""
    tokens, n_all = routing.scores.shape
    n_experts = n_all - n_zero_experts
    counts_all = balance.tokens_per_expert(routing.expert_ids, n_all)
    counts = counts_all[:n_experts]
    part = computing_part(routing, n_experts) if n_zero_experts else routing
    return MoEStats(
        tokens_per_expert=counts,
        max_vio=balance.max_violation(counts),
        balance_loss=balance.batch_balance_loss(part),
        seq_balance_loss=balance.sequence_balance_loss(part, seq_len or tokens),
        z_loss=balance.router_z_loss(routing.logits),
        dropped=jnp.zeros((), jnp.float32) if dropped is None else dropped.astype(jnp.float32),
        router_probability=balance.router_probability(part.scores),
        router_entropy=jax.lax.stop_gradient(balance.router_entropy(routing.scores)),
        zero_tokens=counts_all[n_experts:],
        active_experts=counts.sum() / tokens,
        expert_ids=routing.expert_ids if return_routing else None,
        weights=routing.weights if return_routing else None,
    )


def computing_part(routing: Routing, n_experts: int) -> Routing:
    """The copies of `routing` that go to computing experts (ids below `n_experts`): a copy to a
    zero-computation expert keeps its place with id `n_experts` (out of range: a dispatcher
    neither moves nor computes it) and weight 0, and scores and logits keep the computing
    experts' columns."""
    computing = routing.expert_ids < n_experts
    return Routing(
        expert_ids=jnp.where(computing, routing.expert_ids, n_experts),
        weights=jnp.where(computing, routing.weights, 0),
        scores=routing.scores[:, :n_experts],
        logits=routing.logits[:, :n_experts],
    )


class MoE(eqx.Module):
    """DeepSeekMoE layer on flat tokens: routed experts (dropless) plus optional shared experts.

    The strategies are values: `topk` (the router's top-k), `dispatcher` and `gmm` (the experts'
    grouped matmul), by default the portable jnp ones, and `bias_update` (the router's
    aux-loss-free bias rule, `dropless._bias_update`; the sign rule by default).
    `dropless.with_backend` swaps the first three in a built model without touching any array.

    `weights_before_down`: each copy's routing weight scales its hidden units, before the
    experts' down projection, and the combine only sums. The same function (the projection is
    linear); the combine's backward then needs no expert outputs, so the step neither keeps nor
    reads them, and the weights' gradient comes from the hidden units instead. The dispatcher
    must give row weights (an `AbstractRowWeightsDispatcher`, such as `SortDispatcher`).

    `n_zero_experts` (LongCat-Flash's zero-computation experts): the router chooses k of
    `spec.n_routed_experts + n_zero_experts`; a copy sent to one of the last `n_zero_experts`
    returns the token itself (`zero_output="identity"`) or nothing ("zero"), times its weight,
    without a matmul: the dispatcher never moves it (no FLOPs, no all-to-all). Their biases
    are driven so that on average `active_experts` computing experts serve a token
    (`bias_target`; None: k * experts / (experts + zero), every choice equally loaded). Needs
    a dispatcher that leaves ids outside its experts alone (`SortDispatcher`,
    `AllToAllDispatcher`) and no group-limited routing (`spec.n_group == 1`).
    `experts_bias`, `swiglu_limit`, `swiglu_alpha`: the routed experts' biases and clamped SwiGLU
    (gpt-oss; `GroupedExperts`).
    """

    router: TopKRouter
    experts: GroupedExperts
    shared: SwiGLU | None
    dispatcher: AbstractDispatcher
    weights_before_down: bool = eqx.field(default=False, static=True)
    n_zero_experts: int = eqx.field(default=0, static=True)
    zero_output: Literal["identity", "zero"] = eqx.field(default="identity", static=True)
    active_experts: float | None = eqx.field(default=None, static=True)

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
        bias_update: AbstractBiasUpdate = SignBiasUpdate(),  # noqa: B008 (immutable)
        weights_before_down: bool = False,
        n_zero_experts: int = 0,
        zero_output: Literal["identity", "zero"] = "identity",
        active_experts: float | None = None,
        experts_bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
        key: PRNGKeyArray,
    ):
        sizes = (dim, moe_intermediate_size, n_shared_experts, n_zero_experts)
        _check_args(*sizes, dtype, dispatcher, gmm, topk)
        _check_zero_experts(spec, n_zero_experts, zero_output, active_experts)
        k_router, k_experts, k_shared = jax.random.split(key, 3)
        choices = spec.n_routed_experts + n_zero_experts
        router_spec = dataclasses.replace(spec, n_routed_experts=choices)
        self.router = TopKRouter(
            dim, router_spec, dtype=dtype, topk=topk, bias_update=bias_update, key=k_router
        )
        self.n_zero_experts = n_zero_experts
        self.zero_output = zero_output
        self.active_experts = active_experts
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
        replay: Int[Array, "tokens k"] | None = None,
    ) -> tuple[Float[Array, "tokens dim"], MoEStats]:
        """`seq_len` groups tokens into sequences for the sequence-wise balance loss;
        `return_routing` (a Python bool) puts the routing's `expert_ids` and `weights` in the
        stats; `replay` (expert ids recorded so) routes the tokens to those experts instead of
        the router's top-k, with weights from the router's scores (`replay_routing`)."""
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
        routing = self.router(x, replay)
        n_experts = self.router.spec.n_routed_experts - self.n_zero_experts  # all devices
        part = computing_part(routing, n_experts) if self.n_zero_experts else routing
        dispatched = self.dispatcher.dispatch(x, part)
        if self.weights_before_down:
            dispatcher = require_row_weights(self.dispatcher)
            row_weights = dispatcher.row_weights(dispatched, part)
            y_rows = self.experts(dispatched.rows, dispatched.group_sizes, row_weights)
            y = dispatcher.sum_copies(y_rows, dispatched, part)
        else:
            y_rows = self.experts(dispatched.rows, dispatched.group_sizes)
            y = self.dispatcher.combine(y_rows, dispatched, part)
        if self.n_zero_experts and self.zero_output == "identity":
            kept = jnp.where(routing.expert_ids >= n_experts, routing.weights, 0).sum(-1)
            y = (y.astype(jnp.float32) + kept[:, None] * x.astype(jnp.float32)).astype(y.dtype)
        if self.shared is not None:
            y = y + self.shared(x)
        stats = routing_stats(
            routing,
            seq_len,
            dispatched.dropped,
            return_routing=return_routing,
            n_zero_experts=self.n_zero_experts,
        )
        return y, stats

    def bias_target(
        self, loads: Float[Array, "*layers choices"]
    ) -> Float[Array, "*layers choices"] | None:
        """The load each choice's bias steers it to, from the step's loads of every choice
        (computing experts, then zero-computation ones): None (the mean) without
        zero-computation experts; with them, `active_experts` per token shared evenly over the
        computing experts and the rest of k over the zero-computation ones."""
        if not self.n_zero_experts:
            return None
        z = self.n_zero_experts
        e = loads.shape[-1] - z
        k = self.router.spec.num_experts_per_tok
        active = k * e / (e + z) if self.active_experts is None else self.active_experts
        tokens = loads.sum(-1, keepdims=True) / k
        share = jnp.concatenate([jnp.full((e,), active / e), jnp.full((z,), (k - active) / z)])
        return tokens * share


def _check_args(
    dim, moe_intermediate_size, n_shared_experts, n_zero_experts, dtype, dispatcher, gmm, topk
) -> None:
    """Raises for a size below its least, a dtype that is not floating-point, or a stage that is
    not an instance of its abstract class."""
    for name, value, least in (
        ("dim", dim, 1),
        ("moe_intermediate_size", moe_intermediate_size, 1),
        ("n_shared_experts", n_shared_experts, 0),
        ("n_zero_experts", n_zero_experts, 0),
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


def _check_zero_experts(spec: RoutingSpec, n_zero: int, output: str, active) -> None:
    if output not in ("identity", "zero"):
        raise ValueError(f"MoE: zero_output ({output!r}) must be 'identity' or 'zero'")
    if not n_zero:
        return
    if spec.n_group != 1:
        raise ValueError(
            f"MoE: n_zero_experts ({n_zero}) needs routing without groups (n_group=1, got "
            f"{spec.n_group})"
        )
    k = spec.num_experts_per_tok
    if active is not None and not 0 < active <= k:
        raise ValueError(f"MoE: active_experts ({active}) must be in (0, k={k}]")
