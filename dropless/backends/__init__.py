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

One strategy per private module: `_sort` (SortDispatcher), `_chunked` (ChunkedGroupedMatmul),
`_capacity` (CapacityGroupedMatmul), `_ragged` (RaggedDot), `_te`, `_pallas` (on the kernels of
`mosaic`), `_ep` (on the buffers and exchanges of `_ep_exchange`), `_nccl_ep` (its sizes,
requirements and bootstrap in `_nccl_ep_setup`); `_oracle` holds the dense references the tests
compare against. `_bundles` builds the first three bundles and loads the others lazily, `_auto`
holds `AutoBackend`, `_swap` holds `with_backend`. The TE, Pallas, tokamax and expert-parallel
names are exported here but imported only when first used.
"""

import importlib

from dropless.backends._auto import AutoBackend
from dropless.backends._backend import Backend, BackendUnavailableError
from dropless.backends._bundles import jnp_backend, jnp_capacity_backend, ragged_backend
from dropless.backends._capacity import CapacityGroupedMatmul
from dropless.backends._chunked import ChunkedGroupedMatmul
from dropless.backends._oracle import OneHotGroupedMatmul, oracle_moe
from dropless.backends._ragged import RaggedDot
from dropless.backends._sort import SortDispatcher
from dropless.backends._swap import with_backend

# Exported without being imported until first used, so that `import dropless` loads none of
# these modules (nor TE, tokamax or Mosaic GPU): name -> its module.
_LAZY = {
    "AllToAllDispatcher": "_ep",
    "ep_backend": "_ep",
    "NcclEPDispatcher": "_nccl_ep",
    "nccl_ep_backend": "_nccl_ep",
    "PallasGroupedMatmul": "_pallas",
    "pallas_backend": "_pallas",
    "TEDispatcher": "_te",
    "TEGroupedMatmul": "_te",
    "TETopK": "_te",
    "te_backend": "_te",
    "te_gmm_backend": "_te",
    "TokamaxGroupedMatmul": "_tokamax",
    "tokamax_backend": "_tokamax",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AllToAllDispatcher",
    "AutoBackend",
    "Backend",
    "BackendUnavailableError",
    "CapacityGroupedMatmul",
    "ChunkedGroupedMatmul",
    "NcclEPDispatcher",
    "OneHotGroupedMatmul",
    "PallasGroupedMatmul",
    "RaggedDot",
    "SortDispatcher",
    "TEDispatcher",
    "TEGroupedMatmul",
    "TETopK",
    "TokamaxGroupedMatmul",
    "ep_backend",
    "jnp_backend",
    "jnp_capacity_backend",
    "nccl_ep_backend",
    "oracle_moe",
    "pallas_backend",
    "ragged_backend",
    "te_backend",
    "te_gmm_backend",
    "tokamax_backend",
    "with_backend",
]
