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

Transformer Engine is imported lazily, inside; asked for without it, without >= 2 GPUs of
compute capability >= 9.0, or with tokens that are not bfloat16, this backend says what is missing.
Not run in this repository's CI (no GPUs there): see tests/backends/test_nccl_ep.py.
"""

import ctypes
import functools
import math
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from dropless.backends.backend import Backend, BackendUnavailableError
from dropless.backends.chunked import ChunkedGroupedMatmul
from dropless.backends.ep import OVERFLOW_MESSAGE, axis_size, check_ep_settings
from dropless.dispatch import AbstractExpertParallelDispatcher, Dispatched
from dropless.routing import JnpTopK

ALIGNMENT = 128  # NCCL EP's high-throughput kernels pad each local expert's rows to this
MIN_NCCL = (2, 30, 4)
MIN_COMPUTE_CAPABILITY = 9.0
INSTALL_HINT = "pip install 'transformer-engine[jax]>=2.20' (built with NCCL EP)"


# --- sizes and requirements (no GPU needed) ------------------------------------------------------


def recv_capacity(
    *,
    n_experts: int,
    k: int,
    tokens_per_rank: int,
    ep: int,
    recv_factor: float | None = None,
    alignment: int = ALIGNMENT,
) -> int:
    """Receive rows per rank, as Transformer Engine sizes them (`get_moe_recv_capacity_per_rank`).

    Worst case (`recv_factor=None`): every copy of the EP group lands here, each local expert's
    block rounded up to `alignment`; else `recv_factor` times the aligned balanced load, capped
    at the worst case.
    """
    for name, value in (("n_experts", n_experts), ("k", k), ("tokens_per_rank", tokens_per_rank)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if ep < 1 or n_experts % ep:
        raise ValueError(f"n_experts ({n_experts}) must be divisible by the expert axis ({ep})")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    if recv_factor is not None and not (math.isfinite(recv_factor) and recv_factor >= 1.0):
        raise ValueError(
            f"recv_factor must be None (worst case, never drops) or a finite number >= 1 (NCCL EP "
            f"sizes from the balanced load upwards), got {recv_factor!r}"
        )
    up = lambda n: -(-n // alignment) * alignment  # noqa: E731
    local = n_experts // ep
    group_tokens = ep * tokens_per_rank
    assignments = group_tokens * min(k, local)
    worst = min(
        local * up(group_tokens), up(assignments + (alignment - 1) * min(local, assignments))
    )
    if recv_factor is None:
        return worst
    balanced = local * up(-(-tokens_per_rank * k // local))
    return min(up(math.ceil(balanced * recv_factor)), worst)


def nccl_version() -> tuple[int, int, int] | None:
    """The version of the libnccl.so.2 this process loads, or None without one."""
    try:
        lib = ctypes.CDLL("libnccl.so.2")
    except OSError:
        return None
    code = ctypes.c_int()
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        return None
    v = code.value  # 2.30.4 -> 23004 (NCCL >= 2.9: major * 10000 + minor * 100 + patch)
    return v // 10000, (v // 100) % 100, v % 100


def missing_requirements(devices: "list[jax.Device] | None" = None) -> list[str]:
    """What this machine lacks for NCCL EP (empty when everything is there)."""
    missing = []
    try:
        import transformer_engine.jax.ep  # noqa: F401
    except Exception as err:  # ImportError, or a broken CUDA install raising anything
        missing.append(f"transformer_engine.jax.ep is not importable ({err}); {INSTALL_HINT}")
    devices = list(jax.devices() if devices is None else devices)
    gpus = [d for d in devices if d.platform == "gpu"]
    if len(gpus) < 2:
        missing.append(
            f">= 2 GPUs (NCCL EP needs an expert group of >= 2 ranks), found {len(gpus)}"
        )
    old = [
        d
        for d in gpus
        if float(getattr(d, "compute_capability", "0") or 0) < MIN_COMPUTE_CAPABILITY
    ]
    if old:
        missing.append(f"GPUs of compute capability >= 9.0 (Hopper+), found {old[0].device_kind}")
    if gpus:
        version = nccl_version()
        if version is None or version < MIN_NCCL:
            found = "none" if version is None else ".".join(map(str, version))
            missing.append(f"NCCL >= {'.'.join(map(str, MIN_NCCL))} (libnccl.so.2), found {found}")
    return missing


def check_available(devices: "list[jax.Device] | None" = None) -> None:
    """Raises `BackendUnavailableError` naming everything NCCL EP lacks here."""
    missing = missing_requirements(devices)
    if missing:
        raise BackendUnavailableError("backend 'nccl_ep' needs: " + "; ".join(missing))


def outer_axis(mesh: jax.sharding.Mesh, axis_name: str = "expert") -> str | None:
    """The one token axis outside the expert axis that TE's EP groups by (None if none)."""
    outer = [a for a in mesh.axis_names if a != axis_name and mesh.shape[a] > 1]
    if len(outer) > 1:
        raise ValueError(
            f"NCCL EP groups ranks by at most one mesh axis besides {axis_name!r}; the mesh "
            f"{dict(mesh.shape)} has {outer} > 1 (use data=N or fsdp=N, not both)"
        )
    if axis_name not in mesh.shape or mesh.shape[axis_name] < 2:
        raise ValueError(
            f"NCCL EP needs mesh axis {axis_name!r} of size >= 2, got {dict(mesh.shape)}"
        )
    return outer[0] if outer else None


def bootstrap(
    mesh: jax.sharding.Mesh,
    *,
    n_experts: int,
    k: int,
    tokens_per_rank: int,
    hidden: int,
    recv_factor: float | None = None,
    axis_name: str = "expert",
) -> int:
    """Initialises NCCL EP for `mesh` (eagerly, once per process, before any jitted step) and
    returns the receive capacity per rank. Overflow is always reported back (never a trap); the
    dispatcher's `overflow` policy decides."""
    outer = outer_axis(mesh, axis_name)
    ep = mesh.shape[axis_name]
    capacity = recv_capacity(
        n_experts=n_experts, k=k, tokens_per_rank=tokens_per_rank, ep=ep, recv_factor=recv_factor
    )
    check_available(list(mesh.devices.flat))
    from transformer_engine.jax.ep import ep_bootstrap
    from transformer_engine.jax.sharding import MeshResource, global_shard_guard

    with mesh, global_shard_guard(MeshResource(dp_resource=outer, ep_resource=axis_name)):
        ep_bootstrap(
            world_size=mesh.size,
            rank=None,
            num_experts=n_experts,
            max_tokens_per_rank=tokens_per_rank,
            recv_capacity_per_rank=capacity,
            hidden_dim=hidden,
            max_token_dtype=jnp.bfloat16,
            drop_on_overflow=True,
        )
    return capacity


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
                "dropless.backends.nccl_ep.bootstrap with this layer's sizes and recv_factor"
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
