"""Backends by name: the registry, `AutoBackend` (what "auto" stands for on this machine), and
`with_backend`."""

import functools
import importlib
import warnings
from collections.abc import Callable

import equinox as eqx
import jax

from dropless.backends.backend import Backend, BackendUnavailableError, has_gpu, is_hopper
from dropless.backends.capacity import CapacityGroupedMatmul
from dropless.backends.chunked import ChunkedGroupedMatmul
from dropless.backends.ep import ep_backend
from dropless.backends.ragged import RaggedDot
from dropless.backends.sort import SortDispatcher
from dropless.dispatch import AbstractDispatcher
from dropless.experts import AbstractGroupedMatmul
from dropless.routing import AbstractTopK, JnpTopK


def _jnp() -> Backend:
    return Backend(SortDispatcher(), ChunkedGroupedMatmul(), JnpTopK())


def _jnp_capacity() -> Backend:
    return Backend(SortDispatcher(), CapacityGroupedMatmul(), JnpTopK())


def _ragged() -> Backend:
    return Backend(SortDispatcher(), RaggedDot(), JnpTopK())


def _lazy(module: str, factory: str) -> Callable[[], Backend]:
    """A registry entry whose module (and its optional dependencies) loads on first use; a
    module that does not import makes the backend unavailable."""

    def make() -> Backend:
        try:
            loaded = importlib.import_module(module)
        except BackendUnavailableError:
            raise
        except ImportError as err:
            raise BackendUnavailableError(f"{module} does not import: {err}") from err
        return getattr(loaded, factory)()

    return make


# Read it to list the names; add to it with `register_backend`.
BACKENDS: dict[str, Callable[[], Backend]] = {
    "jnp": _jnp,
    "jnp-capacity": _jnp_capacity,
    "ragged": _ragged,
    "te": _lazy("dropless.backends.te", "te_backend"),
    "te-gmm": _lazy("dropless.backends.te", "te_gmm_backend"),
    "pallas": _lazy("dropless.backends.pallas", "pallas_backend"),
    "tokamax": _lazy("dropless.backends.tokamax", "tokamax_backend"),
    "ep": ep_backend,
    "nccl_ep": _lazy("dropless.backends.nccl_ep", "nccl_ep_backend"),
}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Makes `name` a backend for `get_backend`, `with_backend` and the command line:
    `factory()` builds its `Backend` (called at each lookup; it may raise
    `BackendUnavailableError` where its dependencies or hardware are missing). A name already
    registered, or "auto", raises ValueError."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_backend: name must be a non-empty str, got {name!r}")
    if name == "auto" or name in BACKENDS:
        raise ValueError(f"register_backend: the backend {name!r} is already registered")
    if not callable(factory) or isinstance(factory, Backend):
        raise TypeError(
            f"register_backend({name!r}, ...): factory must be a function returning a Backend, "
            f"got {factory!r}"
        )
    BACKENDS[name] = factory


_pallas_for_auto = _lazy("dropless.backends.pallas", "pallas_auto_backend")


@functools.cache
def _auto_choice() -> tuple[str, Backend]:
    """The registry name "auto" stands for on this machine, and its bundle."""
    # Ask for TE first: it must load its CUDA libraries before JAX starts its GPU backend.
    # On a Hopper GPU "pallas" wins over "te-gmm": in the proxy-2b train step it is 3.4x
    # faster, since TE's multi-stream grouped GEMM waits on the host at every call; at
    # DeepSeek-V3 layer dims the two are close. "te-gmm" (TE's grouped GEMM, our sort
    # dispatcher and router) elsewhere: TE's own permutation has wrong gradients inside
    # lax.scan. On a GPU without either, "jnp-capacity": its one batched matmul runs at GPU
    # speed, while the chunked loops of "jnp" wait on the host every step.
    try:
        te_gmm, te_error = BACKENDS["te-gmm"](), None
    except BackendUnavailableError as err:
        te_gmm, te_error = None, err
    if is_hopper():
        try:
            return "pallas", _pallas_for_auto()
        except BackendUnavailableError as err:
            warnings.warn(f"backend 'auto': {err}; not using 'pallas'", stacklevel=4)
    if te_gmm is not None:
        return "te-gmm", te_gmm
    if has_gpu():
        warnings.warn(f"backend 'auto': {te_error}; falling back to 'jnp-capacity'", stacklevel=4)
        return "jnp-capacity", _jnp_capacity()
    return "jnp", _jnp()


class AutoBackend(eqx.Module):
    """The best backend this machine runs, as a value (the name "auto" stands for it): on a
    Hopper GPU "pallas" (jnp-capacity for expert widths its kernels cannot tile), on other
    GPUs "te-gmm" where TE imports, else "jnp-capacity"; "jnp" elsewhere.

        model = with_backend(model, AutoBackend())
        name, bundle = AutoBackend().select()     # what it picked here: ("jnp", Backend(...))
    """

    def select(self) -> tuple[str, Backend]:
        """(the registry name of the pick, its Backend), chosen once per process (the machine
        does not change); a warning names each faster choice passed over, and why."""
        return _auto_choice()


def resolve_backend_name(backend: "str | AutoBackend") -> str:
    """The registry name that `backend` runs as here: itself, or the one "auto" picks."""
    if isinstance(backend, AutoBackend) or backend == "auto":
        return AutoBackend().select()[0]
    return backend


def get_backend(backend: "str | Backend | AutoBackend") -> Backend:
    """A Backend from a registry name, "auto" or `AutoBackend()` (the best this machine runs),
    or the Backend itself. A name whose dependencies are missing raises
    `BackendUnavailableError` saying what to install."""
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, AutoBackend) or backend == "auto":
        return AutoBackend().select()[1]
    if backend not in BACKENDS:
        known = ", ".join(sorted([*BACKENDS, "auto"]))
        raise ValueError(f"unknown backend {backend!r}; known backends: {known}")
    bundle = BACKENDS[backend]()
    if not isinstance(bundle, Backend):
        raise TypeError(f"the factory of backend {backend!r} returned {bundle!r}, not a Backend")
    return bundle


def available_backends() -> list[str]:
    """Names in the registry that run as they are on this machine: dependencies and hardware
    present. Not the expert-parallel ones ("ep", "nccl_ep"): their dispatchers exchange tokens
    over an expert axis of a device mesh, so they run only inside a sharded train step, which
    training picks with `--mesh expert=N`."""
    names = []
    for name in BACKENDS:
        try:
            with warnings.catch_warnings():  # listing a bundle is not choosing it
                warnings.simplefilter("ignore")
                bundle = get_backend(name)
        except ImportError:  # BackendUnavailableError, or a registered module that is missing
            continue
        if not bundle.expert_parallel and (not bundle.requires_gpu or has_gpu()):
            names.append(name)
    return names


_STRATEGIES = (AbstractDispatcher, AbstractGroupedMatmul, AbstractTopK)


def with_backend(model, backend: "str | Backend | AutoBackend"):
    """The same model (same arrays) with its MoE stages' strategies replaced by `backend`'s.

    `backend`: a registry name (`BACKENDS`: "jnp", "jnp-capacity", "pallas", "te", ...),
    `AutoBackend()` or "auto" (the best this machine runs; `select` says which), or a `Backend`
    of your own
    strategies, where a stage left as None keeps what the model has. `model` is any pytree
    holding MoE layers (a `MoE`, a `DeepSeekV3`, a list of them): every dispatcher, grouped
    matmul and router top-k in it is swapped; nothing else changes, so outputs agree across
    backends up to rounding."""
    bundle = get_backend(backend)
    swaps = (
        (AbstractDispatcher, bundle.dispatcher),
        (AbstractGroupedMatmul, bundle.gmm),
        (AbstractTopK, bundle.topk),
    )

    def swap(node):
        for kind, strategy in swaps:
            if isinstance(node, kind) and strategy is not None:
                return strategy
        return node

    return jax.tree_util.tree_map(swap, model, is_leaf=lambda node: isinstance(node, _STRATEGIES))
