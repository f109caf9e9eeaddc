"""Backends: named bundles of parameter-free strategies, swapped into a model without touching
its arrays.

    model = dropless.with_backend(model, "ragged")
    model = dropless.with_backend(model, Backend(dispatcher=SortDispatcher(), gmm=RaggedDot()))

Names: "jnp" (the default: sort dispatch + chunked grouped matmul), "jnp-capacity" (slots per
expert + chunked overflow: one big batched matmul, for accelerators), "ragged" (sort dispatch +
`jax.lax.ragged_dot`), "te" and its mixes (Transformer Engine, GPU), "pallas" (our Mosaic GPU
grouped GEMM kernels, Hopper), "ep" (XLA expert parallelism), "nccl_ep" (expert parallelism
through TE's NCCL EP, several Hopper GPUs), and "auto" (on a Hopper GPU "pallas", with
jnp-capacity for expert widths its kernels cannot tile; on other GPUs "te-gmm" where TE
imports, else "jnp-capacity"; "jnp" elsewhere).
"""

import functools
import importlib
import warnings
from collections.abc import Callable

import equinox as eqx
import jax

from dropless.backends.jnp import (
    CapacityGroupedMatmul,
    ChunkedGroupedMatmul,
    RaggedDot,
    SortDispatcher,
)
from dropless.dispatch import AbstractDispatcher
from dropless.experts import AbstractGroupedMatmul
from dropless.routing import AbstractTopK, JnpTopK


class Backend(eqx.Module):
    """One strategy per stage. `topk=None` keeps whatever top-k the router has."""

    dispatcher: AbstractDispatcher
    gmm: AbstractGroupedMatmul
    topk: AbstractTopK | None = None

    def __check_init__(self):
        for name, value, kind, wanted in (
            ("dispatcher", self.dispatcher, AbstractDispatcher, "an AbstractDispatcher"),
            ("gmm", self.gmm, AbstractGroupedMatmul, "an AbstractGroupedMatmul"),
            ("topk", self.topk, AbstractTopK | None, "an AbstractTopK or None"),
        ):
            if not isinstance(value, kind):
                hint = " (a backend's name goes to with_backend or get_backend)"
                raise TypeError(
                    f"Backend.{name} must be {wanted}, got {value!r}"
                    f"{hint if isinstance(value, str) else ''}"
                )

    @property
    def requires_gpu(self) -> bool:
        parts = (self.dispatcher, self.gmm, self.topk)
        return any(type(p).requires_gpu for p in parts if p is not None)


class BackendUnavailableError(ImportError):
    """A backend was asked for by name but its dependencies or hardware are missing."""


def _jnp() -> Backend:
    return Backend(SortDispatcher(), ChunkedGroupedMatmul(), JnpTopK())


def _jnp_capacity() -> Backend:
    return Backend(SortDispatcher(), CapacityGroupedMatmul(), JnpTopK())


def _ragged() -> Backend:
    return Backend(SortDispatcher(), RaggedDot(), JnpTopK())


def _lazy(module: str, factory: str) -> Callable[[], Backend]:
    """A registry entry whose module (and its optional dependencies) loads on first use."""

    def make() -> Backend:
        return getattr(importlib.import_module(module), factory)()

    return make


BACKENDS: dict[str, Callable[[], Backend]] = {
    "jnp": _jnp,
    "jnp-capacity": _jnp_capacity,
    "ragged": _ragged,
    "te": _lazy("dropless.backends.te", "te_backend"),
    "te-permute": _lazy("dropless.backends.te", "te_permute_backend"),
    "te-gmm": _lazy("dropless.backends.te", "te_gmm_backend"),
    "te-fp8": _lazy("dropless.backends.te", "te_fp8_backend"),
    "pallas": _lazy("dropless.backends.pallas", "pallas_backend"),
    "tokamax": _lazy("dropless.backends.tokamax", "tokamax_backend"),
    "ep": _lazy("dropless.backends.ep", "ep_backend"),
    "nccl_ep": _lazy("dropless.backends.nccl_ep", "nccl_ep_backend"),
}


def _has_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


_pallas_for_auto = _lazy("dropless.backends.pallas", "pallas_auto_backend")


def _is_hopper() -> bool:
    """Whether the first device is a Hopper GPU (compute capability 9.x): our Mosaic kernels'
    warpgroup matmuls need one."""
    device = jax.devices()[0]
    capability = str(getattr(device, "compute_capability", ""))
    return device.platform == "gpu" and capability.startswith("9.")


def _auto() -> Backend:
    return _auto_choice()[1]


@functools.cache
def _auto_choice() -> tuple[str, Backend]:
    """The registry name "auto" stands for on this machine, and its bundle."""
    # Ask for TE first: it must load its CUDA libraries before JAX starts its GPU backend.
    # On a Hopper GPU "pallas" wins over "te-gmm" (docs/benchmarks.md): in the proxy-2b train
    # step it is several times faster, since TE's multi-stream grouped GEMM waits on the host
    # at every call; at DeepSeek-V3 layer dims the two are close. "te-gmm" (TE's grouped GEMM,
    # our sort dispatcher and router) elsewhere; TE's permutation ("te-permute") has wrong
    # gradients inside lax.scan. On a GPU without either, "jnp-capacity": its one batched
    # matmul runs at GPU speed, while the chunked loops of "jnp" wait on the host every step.
    try:
        te_gmm, te_error = BACKENDS["te-gmm"](), None
    except BackendUnavailableError as err:
        te_gmm, te_error = None, err
    if _is_hopper():
        try:
            return "pallas", _pallas_for_auto()
        except BackendUnavailableError as err:
            warnings.warn(f"backend 'auto': {err}; not using 'pallas'", stacklevel=4)
    if te_gmm is not None:
        return "te-gmm", te_gmm
    if _has_gpu():
        warnings.warn(f"backend 'auto': {te_error}; falling back to 'jnp-capacity'", stacklevel=4)
        return "jnp-capacity", _jnp_capacity()
    return "jnp", _jnp()


def resolve_backend_name(backend: str) -> str:
    """The registry name that `backend` runs as here: itself, or the one "auto" picks."""
    return _auto_choice()[0] if backend == "auto" else backend


def get_backend(backend: "str | Backend") -> Backend:
    """A Backend from a registry name (or the Backend itself)."""
    if isinstance(backend, Backend):
        return backend
    if backend == "auto":
        return _auto()
    if backend not in BACKENDS:
        known = ", ".join(sorted([*BACKENDS, "auto"]))
        raise ValueError(f"unknown backend {backend!r}; known backends: {known}")
    return BACKENDS[backend]()


def available_backends() -> list[str]:
    """Names in the registry that load on this machine (dependencies and hardware present)."""
    names = []
    for name, make in BACKENDS.items():
        try:
            with warnings.catch_warnings():  # listing a bundle is not choosing it
                warnings.simplefilter("ignore")
                bundle = make()
        except (BackendUnavailableError, ModuleNotFoundError):
            continue
        if not bundle.requires_gpu or _has_gpu():
            names.append(name)
    return names


_STRATEGIES = (AbstractDispatcher, AbstractGroupedMatmul, AbstractTopK)


def with_backend(model, backend: "str | Backend"):
    """The same model (same arrays) with every MoE stage's strategy replaced by `backend`'s.

    `backend`: a registry name (`BACKENDS`: "jnp", "jnp-capacity", "pallas", "te", ...), "auto"
    (the best this machine runs, `resolve_backend_name` says which), or a `Backend` of your own
    strategies. `model` is any pytree holding MoE layers (a `MoE`, a `DeepSeekV3`, a list of
    them): every dispatcher, grouped matmul and (unless the bundle's `topk` is None) router
    top-k in it is swapped; nothing else changes, so outputs agree across backends up to
    rounding. A name whose dependencies are missing raises `BackendUnavailableError` saying
    what to install."""
    bundle = get_backend(backend)

    def swap(node):
        if isinstance(node, AbstractDispatcher):
            return bundle.dispatcher
        if isinstance(node, AbstractGroupedMatmul):
            return bundle.gmm
        if isinstance(node, AbstractTopK) and bundle.topk is not None:
            return bundle.topk
        return node

    return jax.tree_util.tree_map(swap, model, is_leaf=lambda node: isinstance(node, _STRATEGIES))
