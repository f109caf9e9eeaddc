"""Backends by name, at the config edge: the names that `dropless train --backend`, a config
file's and config.yaml's `backend:`, `train(..., backend=...)` and `load_run` accept. The core
takes `Backend` values only; this table turns a name into one.

    get_backend("jnp-capacity")                 # -> Backend(SortDispatcher(), ...)
    register_backend("mine", lambda: Backend(gmm=MyGroupedMatmul()))   # now --backend mine

"auto" is no entry: it names the value `AutoBackend()`, whose `select` says what it picked.
"""

import warnings
from collections.abc import Callable

from dropless.backends._auto import AutoBackend
from dropless.backends._backend import Backend, has_gpu
from dropless.backends._bundles import jnp_backend, jnp_capacity_backend, lazy, ragged_backend
from dropless.backends._ep import ep_backend

AUTO = "auto"

# Read it to list the names; add to it with `register_backend`.
BACKENDS: dict[str, Callable[[], Backend]] = {
    "jnp": jnp_backend,
    "jnp-capacity": jnp_capacity_backend,
    "ragged": ragged_backend,
    "te": lazy("dropless.backends._te", "te_backend"),
    "te-gmm": lazy("dropless.backends._te", "te_gmm_backend"),
    "pallas": lazy("dropless.backends._pallas", "pallas_backend"),
    "tokamax": lazy("dropless.backends._tokamax", "tokamax_backend"),
    "ep": ep_backend,
    "nccl_ep": lazy("dropless.backends._nccl_ep", "nccl_ep_backend"),
}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Makes `name` a backend for `get_backend`, `train`, `load_run` and the command line:
    `factory()` builds its `Backend` (called at each lookup; it may raise
    `BackendUnavailableError` where its dependencies or hardware are missing). A name already
    registered, or "auto", raises ValueError."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_backend: name must be a non-empty str, got {name!r}")
    if name == AUTO or name in BACKENDS:
        raise ValueError(f"register_backend: the backend {name!r} is already registered")
    if not callable(factory) or isinstance(factory, Backend):
        raise TypeError(
            f"register_backend({name!r}, ...): factory must be a function returning a Backend, "
            f"got {factory!r}"
        )
    BACKENDS[name] = factory


def backend_choices() -> tuple[str, ...]:
    """ "auto" and every registered name, as the table is when asked (so a name that
    `register_backend` adds reaches `--backend` and a config file's `backend:`)."""
    return (AUTO, *BACKENDS)


def resolve_backend_name(backend: str | AutoBackend) -> str:
    """The name that `backend` runs as here: itself, or the one "auto" picks."""
    if isinstance(backend, AutoBackend) or backend == AUTO:
        return AutoBackend().select()[0]
    return backend


def get_backend(backend: str | Backend | AutoBackend) -> Backend:
    """A Backend from a name, "auto" or `AutoBackend()` (the best this machine runs), or the
    Backend itself. A name whose dependencies are missing raises `BackendUnavailableError`
    saying what to install."""
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, AutoBackend) or backend == AUTO:
        return AutoBackend().select()[1]
    if backend not in BACKENDS:
        known = ", ".join(sorted([*BACKENDS, AUTO]))
        raise ValueError(f"unknown backend {backend!r}; known backends: {known}")
    bundle = BACKENDS[backend]()
    if not isinstance(bundle, Backend):
        raise TypeError(f"the factory of backend {backend!r} returned {bundle!r}, not a Backend")
    return bundle


def available_backends() -> list[str]:
    """Names that run as they are on this machine: dependencies and hardware present. Not the
    expert-parallel ones ("ep", "nccl_ep"): their dispatchers exchange tokens over an expert
    axis of a device mesh, so they run only inside a sharded train step, which training picks
    with `--mesh expert=N`."""
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
