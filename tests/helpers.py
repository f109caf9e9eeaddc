"""What the property tests share (as Lineax's tests/helpers.py does): the one list of strategy
values they run over, the test doubles and switches they need, and the comparisons with a
reference that the Hugging Face tests share. Imported as `helpers`
(tests/ is on the path through tests/conftest.py).

Tests import the public API (a package's re-exports) where a name is exported, and check private
modules' internals (`dropless.backends._chunked.default_chunk`, kernel settings, monkeypatch
targets) directly from the `_name` module that defines them."""

import contextlib
import dataclasses
import importlib.util
import pathlib
import threading
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from safetensors.numpy import load_file

from dropless import AbstractGroupedMatmul
from dropless.backends import (
    Backend,
    BackendUnavailableError,
    CapacityGroupedMatmul,
    ChunkedGroupedMatmul,
    jnp_backend,
    jnp_capacity_backend,
    ragged_backend,
)
from dropless.backends._bundles import lazy
from dropless.backends._capacity import capacity_grouped_matmul
from dropless.backends._chunked import default_capacity


class FlatWalk(AbstractGroupedMatmul):
    """`CapacityGroupedMatmul`'s overflow loop as it walks on an accelerator (one flat loop,
    here 3 chunks per trip), run on any platform."""

    requires_gpu = False

    capacity_factor: float
    chunk: int
    chunks_per_trip: int = 3

    def _impl(self, lhs, rhs, group_sizes):
        rows, n_experts = lhs.shape[0], rhs.shape[0]
        capacity = min(default_capacity(rows, n_experts, self.capacity_factor), rows)
        return capacity_grouped_matmul(
            lhs, rhs, group_sizes, capacity, self.chunk, self.chunks_per_trip
        )


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A strategy value under test. `shipped`: a single-device backend as dropless ships it
    (the layer and model tests run over these); else settings of a stage that take code paths
    of their own (the stage's tests run over those too)."""

    id: str
    make: Callable[[], Backend]
    shipped: bool = True


def _has_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


# The one list of strategy values. The GPU bundles load their modules lazily, as the command
# line's names do; where one does not load or needs a GPU, its tests are skipped, saying why.
STRATEGIES = [
    Strategy("jnp", jnp_backend),
    Strategy("jnp-capacity", jnp_capacity_backend),
    Strategy("ragged", ragged_backend),
    Strategy("te", lazy("dropless.backends._te", "te_backend")),
    Strategy("te-gmm", lazy("dropless.backends._te", "te_gmm_backend")),
    Strategy("pallas", lazy("dropless.backends._pallas", "pallas_backend")),
    Strategy("tokamax", lazy("dropless.backends._tokamax", "tokamax_backend")),
    Strategy("chunk=16", lambda: Backend(gmm=ChunkedGroupedMatmul(chunk=16)), shipped=False),
    Strategy("chunk=64", lambda: Backend(gmm=ChunkedGroupedMatmul(chunk=64)), shipped=False),
    # most rows overflow the slots
    Strategy(
        "capacity=0.5,chunk=16",
        lambda: Backend(gmm=CapacityGroupedMatmul(capacity_factor=0.5, chunk=16)),
        shipped=False,
    ),
    # the accelerators' one flat loop
    Strategy("flat-walk", lambda: Backend(gmm=FlatWalk(capacity_factor=0.5, chunk=8)), False),
]


def _param(strategy: Strategy, value) -> "pytest.ParameterSet":
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            backend = strategy.make()
    except BackendUnavailableError as err:
        return pytest.param(None, id=strategy.id, marks=pytest.mark.skip(reason=str(err)))
    if backend.requires_gpu and not _has_gpu():
        return pytest.param(None, id=strategy.id, marks=pytest.mark.skip(reason="needs a GPU"))
    return pytest.param(value(backend), id=strategy.id)


def backends() -> list:
    """Each shipped single-device backend, as a `Backend` value: what the layer and model
    property tests run over."""
    return [_param(s, lambda b: b) for s in STRATEGIES if s.shipped]


def grouped_matmuls() -> list:
    """The grouped matmul of every strategy of the list that runs on any platform: what the
    grouped-matmul property tests run over."""
    params = []
    for strategy in STRATEGIES:
        param = _param(strategy, lambda b: b.gmm)
        gmm = param.values[0]
        if gmm is not None and not type(gmm).requires_gpu:
            params.append(param)
    return params


def gpu_backends() -> list:
    """Each shipped backend of the list whose kernels need a GPU, as a `Backend` value: what
    the GPU tests run over (skipped, saying why, where one does not load or there is no GPU)."""
    params = [_param(s, lambda b: b) for s in STRATEGIES if s.shipped]
    return [p for p in params if p.values[0] is None or p.values[0].requires_gpu]


def gpu_grouped_matmuls() -> list:
    """The grouped matmul of each `gpu_backends` entry, each kind once."""
    params, kinds = [], set()
    for param in gpu_backends():
        backend = param.values[0]
        if backend is None:
            params.append(param)
        elif type(backend.gmm) not in kinds:
            kinds.add(type(backend.gmm))
            params.append(pytest.param(backend.gmm, id=param.id))
    return params


@contextlib.contextmanager
def jaxtyping_disabled():
    """The tests' runtime type checks off: what a user's script, without them, reaches."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def mosaic_threads_compiled_once(monkeypatch) -> None:
    """Mosaic GPU's interpreter runs a kernel's body in a thread for each warpgroup of each
    thread block, compiling it in each thread and on every call with JAX 0.10 (a new function
    each time misses jit's cache; JAX 0.12 makes it top-level). Here the threads and calls of
    one traced kernel share one compiled body, compiled under a lock: the same program,
    run in the same threads, in a third of the time."""
    from jax._src import core as jax_core

    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # a JAX laid out otherwise: the interpreter as it is
        return
    if not hasattr(thread_map, "_run_jaxpr"):
        return
    lock, compiled = threading.Lock(), {}

    def eval_jaxpr(jaxpr, consts, *args):
        jax_core.eval_jaxpr(jaxpr, consts, *args)

    def run_jaxpr(jaxpr, consts, *args):
        with lock:
            if jaxpr not in compiled:
                traced = jax.jit(eval_jaxpr, static_argnums=0).trace(jaxpr, consts, *args)
                compiled[jaxpr] = traced.lower().compile()
        compiled[jaxpr](consts, *args)

    monkeypatch.setattr(thread_map, "_run_jaxpr", run_jaxpr)


def load_script(name: str):
    """A script of experiments/ or benchmarks/ (where it is), as a module."""
    root = pathlib.Path(__file__).resolve().parents[1]
    folder = (
        root / "experiments"
        if (root / "experiments" / f"{name}.py").exists()
        else root / "benchmarks"
    )
    spec = importlib.util.spec_from_file_location(f"{folder.name}_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_err(ours, ref) -> float:
    """The largest absolute difference over the reference's largest magnitude, in float64."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of the `*.safetensors` files in `path`, read by safetensors itself."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def next_token_loss(model, tokens):
    """The mean next-token cross-entropy of the model's main head, in float32."""
    logits = model(tokens).logits[:, :-1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
