"""The bundles that ship with dropless, as functions that build their `Backend` values:
`jnp_backend`, `jnp_capacity_backend` and `ragged_backend` here; the ones that need an optional
library or a GPU in their own modules (`te.te_backend`, `pallas.pallas_backend`,
`tokamax.tokamax_backend`, `ep.ep_backend`, `nccl_ep.nccl_ep_backend`), reached through
`lazy`, so that `import dropless` loads none of them."""

import importlib
from collections.abc import Callable

from dropless._routing import JnpTopK
from dropless.backends._backend import Backend, BackendUnavailableError
from dropless.backends._capacity import CapacityGroupedMatmul
from dropless.backends._chunked import ChunkedGroupedMatmul
from dropless.backends._ragged import RaggedDot
from dropless.backends._sort import SortDispatcher


def jnp_backend() -> Backend:
    """Sort dispatch, the chunked grouped matmul, jnp top-k: the defaults, portable."""
    return Backend(SortDispatcher(), ChunkedGroupedMatmul(), JnpTopK())


def jnp_capacity_backend() -> Backend:
    """Sort dispatch, slots per expert with a chunked overflow (one big batched matmul, for
    accelerators), jnp top-k."""
    return Backend(SortDispatcher(), CapacityGroupedMatmul(), JnpTopK())


def ragged_backend() -> Backend:
    """Sort dispatch, `jax.lax.ragged_dot`, jnp top-k."""
    return Backend(SortDispatcher(), RaggedDot(), JnpTopK())


def lazy(module: str, factory: str) -> Callable[[], Backend]:
    """A function that builds the bundle `module.factory()`, importing `module` (and the
    optional library it wraps) on its first call; a module that does not import makes the
    bundle unavailable (`BackendUnavailableError`)."""

    def make() -> Backend:
        try:
            loaded = importlib.import_module(module)
        except BackendUnavailableError:
            raise
        except ImportError as err:
            raise BackendUnavailableError(f"{module} does not import: {err}") from err
        return getattr(loaded, factory)()

    return make
