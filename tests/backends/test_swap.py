"""`Backend` values with stages left out, `AutoBackend`, and `with_backend`."""

import jax
import pytest
from jaxtyping import TypeCheckError

from dropless import AbstractRowWeightsDispatcher, AbstractTopK, JnpTopK, MoE, RoutingSpec
from dropless.backends import (
    AutoBackend,
    Backend,
    CapacityGroupedMatmul,
    RaggedDot,
    SortDispatcher,
    jnp_backend,
    with_backend,
)
from dropless.backends._backend import has_gpu
from tests.helpers import jaxtyping_disabled


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


def test_a_name_is_refused_with_where_names_go():
    # the tests' runtime type checks object first (naming `backend`); a user's script reaches
    # the function's own message
    with pytest.raises((TypeError, TypeCheckError), match="backend"):
        with_backend(_layer(), "ragged")
    with jaxtyping_disabled(), pytest.raises(TypeError, match=r"train.get_backend\('ragged'\)"):
        with_backend(_layer(), "ragged")


def test_auto_is_a_value_that_says_what_it_picked():
    name, bundle = AutoBackend().select()
    assert isinstance(name, str) and isinstance(bundle, Backend)
    assert AutoBackend().select() == (name, bundle)  # chosen once
    if not has_gpu():
        assert (name, bundle) == ("jnp", jnp_backend())
    swapped = with_backend(_layer(), AutoBackend())
    assert swapped.experts.gmm == bundle.gmm and swapped.dispatcher == bundle.dispatcher
