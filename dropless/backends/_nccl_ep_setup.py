"""What NCCL EP needs before a step runs: the receive buffer's size (as Transformer Engine
computes it), what this machine lacks for it, the mesh axis TE groups ranks by, and `bootstrap`,
which initialises it once per process. None of it needs a GPU to import or to size; the
dispatcher itself is in `dropless.backends._nccl_ep`."""

import ctypes
import math

import jax
import jax.numpy as jnp

from dropless.backends._backend import BackendUnavailableError

ALIGNMENT = 128  # NCCL EP's high-throughput kernels pad each local expert's rows to this
MIN_NCCL = (2, 30, 4)
MIN_COMPUTE_CAPABILITY = 9.0
INSTALL_HINT = "pip install 'transformer-engine[jax]>=2.20' (built with NCCL EP)"


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
