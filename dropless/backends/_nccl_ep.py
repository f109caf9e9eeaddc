"""Transformer Engine's NCCL EP behind the dispatcher interface (several Hopper+ GPUs).

NCCL EP (NCCL >= 2.30.4) moves token copies between GPUs with device-initiated transfers instead
of XLA collectives. Transformer Engine (2.20) wraps it as JAX primitives: `ep_prepare` (routing
metadata and per-expert counts), `ep_dispatch`, `ep_combine` and their backward ops. TE uses them
at the global (GSPMD) view; `NcclEPDispatcher` binds the same primitives per shard (what TE's own
partitioning rules run on each device), so it plugs into the MoE layer inside `jax.shard_map`
like `AllToAllDispatcher`:

    mesh = dropless.sharding.make_mesh(data=2, expert=4)       # one process per GPU, or XLA's comm
    bootstrap(mesh, n_experts=256, k=8, tokens_per_rank=4096, hidden=7168)  # once, eagerly
    model = dropless.with_backend(model, nccl_ep_backend())     # tokens must be bfloat16

Received rows come grouped by local expert, each group padded to `alignment` (128) rows, which
`group_sizes` includes; padded rows are zeros with zero weight. The receive buffer is TE's
`recv_capacity_per_rank`: the dropless worst case by default, or `recv_factor` (>= 1) times the
balanced load. Overflowing slots are counted (TE reports each rank's pre-drop demand) and the
`overflow` policy raises or drops, as for `AllToAllDispatcher`.

The sizes, the requirements and `bootstrap` are in `dropless.backends._nccl_ep_setup` (and
re-exported here). Transformer Engine is imported lazily, inside; asked for without it, without
>= 2 GPUs of compute capability >= 9.0, or with tokens that are not bfloat16, this backend says
what is missing.
Not run in this repository's CI (no GPUs there): see tests/backends/test_nccl_ep.py.
"""

import functools
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from dropless._dispatch import AbstractExpertParallelDispatcher, Dispatched
from dropless._routing import JnpTopK
from dropless.backends._backend import Backend
from dropless.backends._chunked import ChunkedGroupedMatmul
from dropless.backends._ep import OVERFLOW_MESSAGE, axis_size, check_ep_settings
from dropless.backends._nccl_ep_setup import (
    ALIGNMENT,
    bootstrap,
    check_available,
    missing_requirements,
    nccl_version,
    outer_axis,
    recv_capacity,
)

# --- the primitives, per shard ---------------------------------------------------------------


def _te_ep():
    from transformer_engine.jax.cpp_extensions import ep

    return ep


class NcclEPPlan(eqx.Module):
    handle_mem: Array  # NCCL EP's routing state for this layer call (opaque bytes)
    recv_weights: Float[Array, " rows"]  # routing weight of each received row (0: padding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dispatch(tokens, topk_idx, topk_weights, k: int, alignment: int, capacity: int):
    return _dispatch_fwd(tokens, topk_idx, topk_weights, k, alignment, capacity)[0]


def _dispatch_fwd(tokens, topk_idx, topk_weights, k, alignment, capacity):
    ep = _te_ep()
    counts, demand, handle = ep.EpPreparePrimitive.impl(topk_idx, k, alignment, False)
    rows, weights = ep.EpDispatchPrimitive.impl(
        handle, topk_idx, tokens, topk_weights, k, alignment, capacity, False
    )
    return (rows[0], weights[0], handle, counts[0], demand[0, 0]), (handle, tokens.shape[0])


def _dispatch_bwd(k, alignment, capacity, res, g):
    handle, tokens = res
    g_rows, g_weights = g[0], g[1]
    g_tokens, g_topk_weights = _te_ep().EpDispatchBwdPrimitive.impl(
        handle, g_rows[None], g_weights[None].astype(jnp.float32), k, alignment, (tokens,), None
    )
    return g_tokens, None, g_topk_weights


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _combine(weighted, handle, k: int, alignment: int, tokens: int):
    return _te_ep().EpCombinePrimitive.impl(handle, weighted[None], k, alignment, (tokens,), None)


def _combine_fwd(weighted, handle, k, alignment, tokens):
    return _combine(weighted, handle, k, alignment, tokens), (handle, weighted.shape[0])


def _combine_bwd(k, alignment, tokens, res, g):
    handle, capacity = res
    g_rows = _te_ep().EpCombineBwdPrimitive.impl(handle, g, k, alignment, capacity, False)
    return g_rows[0], None


_combine.defvjp(_combine_fwd, _combine_bwd)


# --- the dispatcher ----------------------------------------------------------------------------


class NcclEPDispatcher(AbstractExpertParallelDispatcher):
    """Expert-parallel dispatch through NCCL EP, inside `jax.shard_map` over `axis_name`.

    Needs `bootstrap(mesh, ...)` first, with the same `recv_factor`, and bfloat16 tokens.
    """

    axis_name: str = eqx.field(default="expert", static=True)
    recv_factor: float | None = eqx.field(default=None, static=True)
    overflow: Literal["raise", "drop"] = eqx.field(default="raise", static=True)
    alignment: int = eqx.field(default=ALIGNMENT, static=True)

    requires_gpu: ClassVar[bool] = True

    def __check_init__(self):
        check_ep_settings(self.axis_name, self.recv_factor)
        if self.overflow not in ("raise", "drop"):
            raise ValueError(f"overflow must be 'raise' or 'drop', got {self.overflow!r}")
        if isinstance(self.alignment, bool) or not isinstance(self.alignment, int):
            raise ValueError(f"alignment must be an int >= 1, got {self.alignment!r}")
        if self.alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {self.alignment}")
        recv_capacity(n_experts=1, k=1, tokens_per_rank=1, ep=1, recv_factor=self.recv_factor)

    def _capacity(self, tokens: int, k: int, n_experts: int, ep: int) -> int:
        capacity = recv_capacity(
            n_experts=n_experts,
            k=k,
            tokens_per_rank=tokens,
            ep=ep,
            recv_factor=self.recv_factor,
            alignment=self.alignment,
        )
        booted = _te_ep().get_ep_config()  # raises if bootstrap() was not called
        if (booted.num_experts, booted.ep_size, booted.recv_capacity_per_rank) != (
            n_experts,
            ep,
            capacity,
        ) or tokens > booted.max_tokens_per_rank:
            raise ValueError(
                f"NCCL EP was bootstrapped for {booted}, but this layer needs n_experts="
                f"{n_experts}, ep={ep}, tokens_per_rank>={tokens}, recv capacity {capacity}; call "
                "dropless.backends._nccl_ep.bootstrap with this layer's sizes and recv_factor"
            )
        return capacity

    def _dispatch(self, x, routing):
        if x.dtype != jnp.bfloat16:
            raise ValueError(
                f"NCCL EP moves bfloat16 tokens, got {x.dtype}: run the MoE layer in bfloat16 "
                "(or use the 'ep' backend, which takes any dtype)"
            )
        check_available()
        ep = axis_size(self.axis_name)
        tokens, k = routing.expert_ids.shape
        capacity = self._capacity(tokens, k, routing.scores.shape[-1], ep)
        rows, weights, handle, counts, demand = _dispatch(
            x,
            routing.expert_ids.astype(jnp.int32),
            routing.weights.astype(jnp.float32),
            k,
            self.alignment,
            capacity,
        )
        dropped = jnp.maximum(demand - capacity, 0).astype(jnp.float32)
        if self.recv_factor is not None and self.overflow == "raise":
            anywhere = jax.lax.psum(dropped, self.axis_name)
            flag = eqx.error_if(jnp.zeros((), rows.dtype), anywhere > 0, OVERFLOW_MESSAGE)
            rows = rows + flag
        plan = NcclEPPlan(handle_mem=handle, recv_weights=weights)
        return Dispatched(rows=rows, group_sizes=counts, plan=plan, dropped=dropped)

    def _combine(self, y_rows, dispatched, routing):
        plan: NcclEPPlan = dispatched.plan
        w = plan.recv_weights[:, None]
        weighted = jnp.where(w != 0, y_rows.astype(jnp.float32) * w, 0).astype(y_rows.dtype)
        return _combine(
            weighted,
            plan.handle_mem,
            routing.expert_ids.shape[1],
            self.alignment,
            routing.expert_ids.shape[0],
        )


def nccl_ep_backend(
    axis_name: str = "expert",
    *,
    recv_factor: float | None = None,
    overflow: Literal["raise", "drop"] = "raise",
):
    """The "nccl_ep" bundle: NCCL EP dispatch, chunked grouped matmul, jnp top-k. Raises
    `BackendUnavailableError` (naming what is missing) on machines that cannot run it."""
    check_available()
    dispatcher = NcclEPDispatcher(axis_name=axis_name, recv_factor=recv_factor, overflow=overflow)
    return Backend(dispatcher=dispatcher, gmm=ChunkedGroupedMatmul(), topk=JnpTopK())


__all__ = [
    "ALIGNMENT",
    "NcclEPDispatcher",
    "bootstrap",
    "check_available",
    "missing_requirements",
    "nccl_ep_backend",
    "nccl_version",
    "outer_axis",
    "recv_capacity",
]
