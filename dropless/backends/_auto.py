"""`AutoBackend`: the best bundle this machine runs, as a value that says what it picked."""

import functools
import warnings

import equinox as eqx

from dropless.backends._backend import Backend, BackendUnavailableError, has_gpu, is_hopper
from dropless.backends._bundles import jnp_backend, jnp_capacity_backend, lazy

_te_gmm = lazy("dropless.backends._te", "te_gmm_backend")
_pallas = lazy("dropless.backends._pallas", "pallas_auto_backend")


@functools.cache
def _auto_choice() -> tuple[str, Backend]:
    """The name of the bundle "auto" stands for on this machine, and the bundle."""
    # Ask for TE first: it must load its CUDA libraries before JAX starts its GPU backend.
    # On a Hopper GPU "pallas" wins over "te-gmm": in the proxy-2b train step it is 3.4x
    # faster, since TE's multi-stream grouped GEMM waits on the host at every call; at
    # DeepSeek-V3 layer dims the two are close. "te-gmm" (TE's grouped GEMM, our sort
    # dispatcher and router) elsewhere: TE's own permutation has wrong gradients inside
    # lax.scan. On a GPU without either, "jnp-capacity": its one batched matmul runs at GPU
    # speed, while the chunked loops of "jnp" wait on the host every step.
    try:
        te_gmm, te_error = _te_gmm(), None
    except BackendUnavailableError as err:
        te_gmm, te_error = None, err
    if is_hopper():
        try:
            return "pallas", _pallas()
        except BackendUnavailableError as err:
            warnings.warn(f"backend 'auto': {err}; not using 'pallas'", stacklevel=4)
    if te_gmm is not None:
        return "te-gmm", te_gmm
    if has_gpu():
        warnings.warn(f"backend 'auto': {te_error}; falling back to 'jnp-capacity'", stacklevel=4)
        return "jnp-capacity", jnp_capacity_backend()
    return "jnp", jnp_backend()


class AutoBackend(eqx.Module):
    """The best backend this machine runs, as a value (the name "auto" stands for it): on a
    Hopper GPU "pallas" (jnp-capacity for expert widths its kernels cannot tile), on other
    GPUs "te-gmm" where TE imports, else "jnp-capacity"; "jnp" elsewhere.

        model = with_backend(model, AutoBackend())
        name, bundle = AutoBackend().select()     # what it picked here: ("jnp", Backend(...))
    """

    def select(self) -> tuple[str, Backend]:
        """(the name of the pick, its Backend), chosen once per process (the machine does not
        change); a warning names each faster choice passed over, and why."""
        return _auto_choice()
