"""Dispatch and combine: moving token copies into expert-contiguous rows and back.

A dispatcher is a parameter-free strategy with two methods that form an inverse pair sharing a
`plan`: `dispatch` lays the `tokens * k` copies out so each expert's rows are contiguous (counted
by `group_sizes`), `combine` brings the expert outputs back and takes the weighted sum over k.
"""

import abc
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int

from dropless._routing import Routing


class Dispatched(eqx.Module):
    """Expert-contiguous rows: rows [0, group_sizes[0]) belong to expert 0, and so on.

    `rows` may be longer than `sum(group_sizes)` (a static bound); the tail is padding whose
    outputs `combine` ignores. `plan` is whatever the dispatcher needs to invert itself.
    `dropped` is None for dispatchers that cannot drop (all of them, unless a user shrinks an
    expert-parallel receive buffer below the worst case).
    """

    rows: Float[Array, "rows dim"]
    group_sizes: Int[Array, " experts"]
    plan: Any
    dropped: Float[Array, ""] | None = None  # copies an undersized EP buffer could not hold


class AbstractDispatcher(eqx.Module):
    """Dispatch + combine. Backends fill in `_dispatch` and `_combine`."""

    requires_gpu: eqx.AbstractClassVar[bool]
    """Whether the strategy runs only on a GPU (`available_backends()` and the tests skip it
    elsewhere); every concrete strategy says."""

    def dispatch(self, x: Float[Array, "tokens dim"], routing: Routing) -> Dispatched:
        if routing.expert_ids.shape[0] != x.shape[0]:
            raise ValueError(
                f"routing has {routing.expert_ids.shape[0]} tokens but x has {x.shape[0]}"
            )
        with jax.named_scope("dispatch"):
            return self._dispatch(x, routing)

    def combine(
        self, y_rows: Float[Array, "rows dim"], dispatched: Dispatched, routing: Routing
    ) -> Float[Array, "tokens dim"]:
        if y_rows.shape[0] != dispatched.rows.shape[0]:
            raise ValueError(
                f"combine got {y_rows.shape[0]} rows, dispatch made {dispatched.rows.shape[0]}"
            )
        with jax.named_scope("combine"):
            return self._combine(y_rows, dispatched, routing)

    @abc.abstractmethod
    def _dispatch(self, x: Float[Array, "tokens dim"], routing: Routing) -> Dispatched: ...

    @abc.abstractmethod
    def _combine(
        self, y_rows: Float[Array, "rows dim"], dispatched: Dispatched, routing: Routing
    ) -> Float[Array, "tokens dim"]: ...


class AbstractRowWeightsDispatcher(AbstractDispatcher):
    """A dispatcher that can also give each row its copy's routing weight and combine without
    weights: what a layer that weights the experts' hidden units instead of their outputs
    (`MoE(weights_before_down=True)`) needs. Backends fill in `_row_weights` and `_sum_copies`
    as well."""

    def row_weights(self, dispatched: Dispatched, routing: Routing) -> Float[Array, " rows"]:
        """Each dispatched row's routing weight (0 for padding rows), differentiable in
        `routing.weights`."""
        with jax.named_scope("dispatch"):
            return self._row_weights(dispatched, routing)

    def sum_copies(
        self, y_rows: Float[Array, "rows dim"], dispatched: Dispatched, routing: Routing
    ) -> Float[Array, "tokens dim"]:
        """`combine` with every weight 1: each token's k rows summed. It keeps no rows for its
        backward, where `combine` keeps them for the weights' gradient."""
        with jax.named_scope("combine"):
            return self._sum_copies(y_rows, dispatched, routing)

    @abc.abstractmethod
    def _row_weights(self, dispatched: Dispatched, routing: Routing) -> Float[Array, " rows"]: ...

    @abc.abstractmethod
    def _sum_copies(
        self, y_rows: Float[Array, "rows dim"], dispatched: Dispatched, routing: Routing
    ) -> Float[Array, "tokens dim"]: ...


def require_row_weights(dispatcher: AbstractDispatcher) -> AbstractRowWeightsDispatcher:
    """`dispatcher` itself; raises ValueError, naming it, unless it gives row weights."""
    if not isinstance(dispatcher, AbstractRowWeightsDispatcher):
        raise ValueError(
            f"{type(dispatcher).__name__} cannot give each row its routing weight: "
            "an MoE with weights_before_down=True needs a dispatcher with row weights "
            "(an AbstractRowWeightsDispatcher, such as SortDispatcher)"
        )
    return dispatcher


class AbstractExpertParallelDispatcher(AbstractDispatcher):
    """A dispatcher that exchanges token copies between the devices of the mesh axis
    `axis_name`, each holding its slice of the experts: it runs inside a `jax.shard_map` over
    that axis (a sharded train step, `ShardedMoE`), where `group_sizes` has one entry per local
    expert."""

    axis_name: eqx.AbstractVar[str]
