"""Backends: bundles of parameter-free strategies, swapped into a model without touching its
arrays.

    model = dropless.with_backend(model, ragged_backend())
    model = dropless.with_backend(model, Backend(gmm=RaggedDot()))  # only the grouped matmul

The core takes values; names live at the config edge (`dropless.train.get_backend`, the
command's `--backend`). The built-in bundles, by the names they go by there: "jnp" (the default:
sort dispatch + chunked grouped matmul), "jnp-capacity" (slots per expert + chunked overflow:
one big batched matmul, for accelerators), "ragged" (sort dispatch + `jax.lax.ragged_dot`),
"te" and "te-gmm" (Transformer Engine, GPU), "pallas" (our Mosaic GPU grouped GEMM kernels,
Hopper), "ep" (XLA expert parallelism), "nccl_ep" (expert parallelism through TE's NCCL EP,
several Hopper GPUs), and "auto" (on a Hopper GPU "pallas", with jnp-capacity for expert widths
its kernels cannot tile; on other GPUs "te-gmm" where TE imports, else "jnp-capacity"; "jnp"
elsewhere: the value `AutoBackend()`, whose `select` says which).

One strategy per module: `sort` (SortDispatcher), `chunked` (ChunkedGroupedMatmul), `capacity`
(CapacityGroupedMatmul), `ragged` (RaggedDot), `te`, `pallas` (on the kernels of `mosaic`),
`ep` (on the buffers and exchanges of `ep_exchange`), `nccl_ep` (its sizes, requirements and
bootstrap in `nccl_ep_setup`); `oracle` holds the dense references the tests compare against.
`bundles` builds the first three bundles and loads the others lazily, `auto` holds
`AutoBackend`, `swap` holds `with_backend`.
"""

from dropless.backends.auto import AutoBackend
from dropless.backends.backend import Backend, BackendUnavailableError
from dropless.backends.bundles import jnp_backend, jnp_capacity_backend, ragged_backend
from dropless.backends.capacity import CapacityGroupedMatmul
from dropless.backends.chunked import ChunkedGroupedMatmul
from dropless.backends.ragged import RaggedDot
from dropless.backends.sort import SortDispatcher
from dropless.backends.swap import with_backend

__all__ = [
    "AutoBackend",
    "Backend",
    "BackendUnavailableError",
    "CapacityGroupedMatmul",
    "ChunkedGroupedMatmul",
    "RaggedDot",
    "SortDispatcher",
    "jnp_backend",
    "jnp_capacity_backend",
    "ragged_backend",
    "with_backend",
]
