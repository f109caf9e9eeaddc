"""Backends by name, at the config edge: the table, `register_backend`, `get_backend`,
"auto", and the names the property tests' list of values covers."""

import jax
import pytest
from helpers import STRATEGIES, backends

import dropless
from dropless import MoE, RoutingSpec
from dropless.backends import (
    AutoBackend,
    Backend,
    BackendUnavailableError,
    ChunkedGroupedMatmul,
    RaggedDot,
    jnp_backend,
    with_backend,
)
from dropless.backends._backend import has_gpu
from dropless.backends._bundles import lazy
from dropless.train import (
    BACKENDS,
    available_backends,
    get_backend,
    register_backend,
    resolve_backend_name,
)
from dropless.train import _backend_names as backend_names


@pytest.fixture
def registered(monkeypatch):
    """A copy of the table for the test to add to."""
    monkeypatch.setattr(backend_names, "BACKENDS", dict(BACKENDS))
    return backend_names.BACKENDS


def _layer():
    return MoE(8, 6, RoutingSpec(4, 2, "softmax"), key=jax.random.key(0))


def test_the_core_holds_no_names():
    """Names live here, at the edge: the core package exports no table and no name lookup."""
    for name in ("BACKENDS", "get_backend", "register_backend", "available_backends"):
        assert not hasattr(dropless, name) and not hasattr(dropless.backends, name)
    assert dropless.train.get_backend is get_backend


def test_a_registered_name_works_with_get_backend_and_with_backend(registered):
    register_backend("mine", lambda: Backend(gmm=ChunkedGroupedMatmul(chunk=4)))
    assert "mine" in registered
    assert get_backend("mine") == Backend(gmm=ChunkedGroupedMatmul(chunk=4))
    swapped = with_backend(_layer(), get_backend("mine"))
    assert swapped.experts.gmm == ChunkedGroupedMatmul(chunk=4)
    assert "mine" in available_backends()
    assert "mine" in backend_names.backend_choices()


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
    register_backend("missing", lazy("dropless.backends.no_such_module", "make"))
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
    assert get_backend(jnp_backend()) == jnp_backend()  # a value passes through


def test_the_property_tests_cover_every_single_device_name():
    """The tests' one list of strategy values holds every shipped single-device backend, by the
    name it goes by here, and the same value: a name added to the table and not to the list
    fails here."""
    shipped = {s.id: s for s in STRATEGIES if s.shipped}
    for name, factory in BACKENDS.items():
        try:
            bundle = factory()
        except BackendUnavailableError:
            assert name in shipped or name == "nccl_ep", name
            continue
        if bundle.expert_parallel:
            continue
        assert name in shipped, name
        assert shipped[name].make() == bundle, name
    ids = [param.id for param in backends()]
    assert ids == [name for name in BACKENDS if name in shipped]
