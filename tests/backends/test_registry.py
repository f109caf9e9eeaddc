"""`Backend` values with stages left out, the registry's names, and `with_backend`."""

import jax
import pytest

from dropless.backends import (
    BACKENDS,
    AutoBackend,
    Backend,
    BackendUnavailableError,
    CapacityGroupedMatmul,
    ChunkedGroupedMatmul,
    RaggedDot,
    SortDispatcher,
    available_backends,
    get_backend,
    register_backend,
    registry,
    resolve_backend_name,
    with_backend,
)
from dropless.backends.backend import has_gpu
from dropless.dispatch import AbstractRowWeightsDispatcher
from dropless.moe import MoE
from dropless.routing import AbstractTopK, JnpTopK, RoutingSpec


class MarkedTopK(AbstractTopK):
    """`JnpTopK`'s routing, a type of its own to see whether a swap kept it."""

    requires_gpu = False

    def _impl(self, logits, bias, spec):
        return JnpTopK()(logits, bias, spec)


class MarkedDispatcher(AbstractRowWeightsDispatcher):
    """`SortDispatcher`'s dispatch, a type of its own."""

    requires_gpu = False

    def _dispatch(self, x, routing):
        return SortDispatcher()._dispatch(x, routing)

    def _combine(self, y_rows, dispatched, routing):
        return SortDispatcher()._combine(y_rows, dispatched, routing)

    def _row_weights(self, dispatched, routing):
        return SortDispatcher()._row_weights(dispatched, routing)

    def _sum_copies(self, y_rows, dispatched, routing):
        return SortDispatcher()._sum_copies(y_rows, dispatched, routing)


@pytest.fixture
def registered(monkeypatch):
    """A copy of the registry for the test to add to."""
    monkeypatch.setattr(registry, "BACKENDS", dict(BACKENDS))
    return registry.BACKENDS


def _layer():
    moe = MoE(8, 6, RoutingSpec(4, 2, "softmax"), key=jax.random.key(0))
    return with_backend(moe, Backend(MarkedDispatcher(), CapacityGroupedMatmul(), MarkedTopK()))


def test_a_backend_with_only_a_gmm_swaps_only_the_gmm():
    swapped = with_backend(_layer(), Backend(gmm=RaggedDot()))
    assert type(swapped.experts.gmm) is RaggedDot
    assert type(swapped.dispatcher) is MarkedDispatcher
    assert type(swapped.router.topk) is MarkedTopK


@pytest.mark.parametrize(
    "stage, value, kept",
    [("dispatcher", SortDispatcher(), ("gmm", "topk")), ("topk", JnpTopK(), ("dispatcher", "gmm"))],
)
def test_each_stage_swaps_alone(stage, value, kept):
    before = _layer()
    after = with_backend(before, Backend(**{stage: value}))
    parts = lambda m: {"dispatcher": m.dispatcher, "gmm": m.experts.gmm, "topk": m.router.topk}  # noqa: E731
    assert parts(after)[stage] is value
    for name in kept:
        assert type(parts(after)[name]) is type(parts(before)[name])


def test_an_empty_backend_changes_nothing():
    before = _layer()
    assert with_backend(before, Backend()) == before


def test_a_stage_of_the_wrong_kind_is_named():
    # with the tests' runtime type checks on, the annotation fails first; both name the field
    with pytest.raises(TypeError, match="gmm"):
        Backend(gmm=SortDispatcher())
    with pytest.raises(TypeError, match="dispatcher"):
        Backend(dispatcher="jnp")


def test_a_registered_name_works_with_get_backend_and_with_backend(registered):
    register_backend("mine", lambda: Backend(gmm=ChunkedGroupedMatmul(chunk=4)))
    assert "mine" in registered
    assert get_backend("mine") == Backend(gmm=ChunkedGroupedMatmul(chunk=4))
    swapped = with_backend(_layer(), "mine")
    assert swapped.experts.gmm == ChunkedGroupedMatmul(chunk=4)
    assert type(swapped.dispatcher) is MarkedDispatcher
    assert "mine" in available_backends()


@pytest.mark.parametrize("name", ["jnp", "auto"])
def test_a_name_already_taken_is_refused(registered, name):
    with pytest.raises(ValueError, match=f"the backend '{name}' is already registered"):
        register_backend(name, lambda: Backend())


def test_a_bad_factory_is_named(registered):
    # with the tests' runtime type checks on, the annotation fails first; both name the argument
    with pytest.raises(TypeError, match="factory"):
        register_backend("value", Backend(gmm=RaggedDot()))
    with pytest.raises(TypeError, match="factory"):
        register_backend("number", 3)
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        register_backend("", lambda: Backend())
    register_backend("wrong", lambda: RaggedDot())
    with pytest.raises(TypeError, match="the factory of backend 'wrong' returned RaggedDot"):
        get_backend("wrong")


def test_a_module_that_does_not_import_makes_its_backend_unavailable(registered):
    register_backend("missing", registry._lazy("dropless.backends.no_such_module", "make"))
    with pytest.raises(BackendUnavailableError, match="no_such_module does not import"):
        get_backend("missing")
    assert "missing" not in available_backends()


def test_available_backends_leave_out_expert_parallel_ones():
    """ "ep" loads on a CPU, but its dispatcher needs a device mesh."""
    assert get_backend("ep").expert_parallel
    names = available_backends()
    assert {"jnp", "jnp-capacity", "ragged"} <= set(names)
    assert "ep" not in names and "nccl_ep" not in names
    if not any(d.platform == "gpu" for d in jax.devices()):
        assert names == ["jnp", "jnp-capacity", "ragged"]


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="known backends: auto, ep, jnp"):
        get_backend("nope")


def test_auto_is_a_value_that_says_what_it_picked():
    name, bundle = AutoBackend().select()
    assert name in BACKENDS and name == resolve_backend_name(AutoBackend())
    assert name == resolve_backend_name("auto")
    assert bundle == get_backend(AutoBackend()) == get_backend("auto")
    if not has_gpu():
        assert (name, bundle) == ("jnp", get_backend("jnp"))
    swapped = with_backend(_layer(), AutoBackend())
    assert swapped.experts.gmm == bundle.gmm and swapped.dispatcher == bundle.dispatcher
