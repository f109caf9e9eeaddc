"""tokamax's grouped matmul: `tokamax.ragged_dot`, Google's Pallas kernel library.

On a Hopper GPU `implementation="mosaic"` runs tokamax's Mosaic GPU kernels (forward, and a
custom VJP for both gradients); `"xla"` is its pure-XLA path, which runs anywhere and is what the
CPU tests check against the oracle. tokamax is an optional extra, `.[tokamax]` (0.0.15 or newer,
Python 3.12 or newer; docs/backends.md).
"""

import functools
from typing import ClassVar, Literal

import equinox as eqx
import jax.numpy as jnp

from dropless._experts import AbstractGroupedMatmul
from dropless._routing import JnpTopK
from dropless.backends._backend import Backend, BackendUnavailableError
from dropless.backends._sort import SortDispatcher

Implementation = Literal["mosaic", "triton", "xla"]


@functools.cache
def load_tokamax():
    """The `tokamax` module, or `BackendUnavailableError` saying how to install it; imported
    once per process, when a tokamax strategy is first built or run (importing this module
    does not).

    A process-wide effect: absl's flags are marked parsed (where nothing parsed them yet), so
    tokamax keeps its defaults instead of parsing a command line it does not own."""
    try:
        import tokamax
    except Exception as err:  # an ImportError, or typeguard 4 failing on tokamax's annotations
        raise BackendUnavailableError(
            f"the 'tokamax' backend needs the tokamax package ({type(err).__name__}: {err}); "
            "install it with `pip install -e '.[tokamax]'` (Python 3.12 or newer; "
            "docs/backends.md)"
        ) from err
    # tokamax reads its options from absl flags, parsing sys.argv on first use, which fails on
    # any command line it does not own (pytest's, the dropless command's): its defaults stand.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


class TokamaxGroupedMatmul(AbstractGroupedMatmul):
    """`tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=...)` in `compute_dtype`.

    Rows past `sum(group_sizes)` (an expert-parallel buffer's padding) come out as zeros: the
    kernels leave them unwritten, so they are masked here."""

    requires_gpu: ClassVar[bool] = True
    implementation: Implementation = eqx.field(default="mosaic", static=True)
    compute_dtype: str = eqx.field(default="bfloat16", static=True)

    def __check_init__(self):
        if self.implementation not in ("mosaic", "triton", "xla"):
            raise ValueError(
                f"TokamaxGroupedMatmul.implementation={self.implementation!r} must be 'mosaic', "
                "'triton' or 'xla'"
            )

    def _impl(self, lhs, rhs, group_sizes):
        tokamax = load_tokamax()
        dt = jnp.dtype(self.compute_dtype) if self.implementation != "xla" else lhs.dtype
        group_sizes = group_sizes.astype(jnp.int32)
        out = tokamax.ragged_dot(
            lhs.astype(dt),
            rhs.astype(dt),
            group_sizes,
            preferred_element_type=jnp.float32 if dt == jnp.float32 else None,
            implementation=self.implementation,
        )
        filled = jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes)
        return jnp.where(filled[:, None], out, 0).astype(lhs.dtype)


def tokamax_backend() -> Backend:
    """Our sort dispatcher and router with tokamax's Mosaic GPU grouped matmul."""
    load_tokamax()
    return Backend(dispatcher=SortDispatcher(), gmm=TokamaxGroupedMatmul(), topk=JnpTopK())
