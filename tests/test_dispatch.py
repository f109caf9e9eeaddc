"""Sort dispatch + combine: layout invariants, inverse pair, jit, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless import AbstractDispatcher, AbstractExpertParallelDispatcher, JnpTopK, RoutingSpec
from dropless.backends import AllToAllDispatcher, SortDispatcher
from dropless.backends._oracle import expert_of_row
from dropless.backends._sort import permute_rows

SHAPES = [(16, 8, 2), (33, 4, 4), (64, 16, 3)]  # tokens, experts, k


@st.composite
def case(draw):
    tokens, e, k = draw(st.sampled_from(SHAPES))
    kind = draw(st.sampled_from(["random", "one_expert", "ties", "half_empty"]))
    seed = draw(st.integers(0, 2**31 - 1))
    key = jax.random.key(seed)
    logits = jax.random.normal(key, (tokens, e))
    if kind == "one_expert":
        logits = logits.at[:, e // 2].add(100.0)
    elif kind == "ties":
        logits = jnp.round(logits)
    elif kind == "half_empty":
        logits = logits.at[:, : e // 2].add(-100.0)
    routing = JnpTopK()(logits, None, RoutingSpec(e, k, "softmax"))
    x = jax.random.normal(jax.random.fold_in(key, 1), (tokens, 8))
    return x, routing


@given(case())
def test_layout_is_expert_contiguous_and_complete(c):
    x, routing = c
    tokens, k = routing.expert_ids.shape
    d = SortDispatcher().dispatch(x, routing)
    assert int(d.group_sizes.sum()) == tokens * k
    np.testing.assert_array_equal(
        d.group_sizes,
        np.bincount(np.asarray(routing.expert_ids).ravel(), minlength=d.group_sizes.size),
    )
    owner = np.asarray(expert_of_row(d.group_sizes, d.rows.shape[0]))
    order = np.asarray(d.plan.order)
    # row r holds copy order[r] = (token order[r] // k, slot order[r] % k)
    np.testing.assert_array_equal(np.asarray(routing.expert_ids).ravel()[order], owner)
    np.testing.assert_array_equal(d.rows, np.asarray(x)[order // k])
    assert (np.diff(owner) >= 0).all()


@given(case())
def test_combine_inverts_dispatch(c):
    x, routing = c
    disp = SortDispatcher()
    d = disp.dispatch(x, routing)
    y = disp.combine(d.rows, d, routing)  # identity experts
    np.testing.assert_allclose(y, x * routing.weights.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


@given(case(), st.integers(0, 2**31 - 1))
def test_permuting_tokens_permutes_outputs(c, seed):
    x, routing = c
    perm = jax.random.permutation(jax.random.key(seed), x.shape[0])
    w = jnp.arange(1.0, 9.0)  # experts scale rows by their expert id, so routing matters

    def run(x, routing):
        disp = SortDispatcher()
        d = disp.dispatch(x, routing)
        owner = expert_of_row(d.group_sizes, d.rows.shape[0])
        return disp.combine(d.rows * (owner[:, None] + 1) * w, d, routing)

    permuted = jax.tree_util.tree_map(lambda a: a[perm], routing)
    np.testing.assert_allclose(run(x, routing)[perm], run(x[perm], permuted), rtol=1e-6)


def test_permute_rows_gradient_matches_plain_gather():
    x = jax.random.normal(jax.random.key(0), (10, 3))
    perm = jax.random.permutation(jax.random.key(1), 10)
    inverse = jnp.argsort(perm)
    probe = jax.random.normal(jax.random.key(2), (10, 3))
    g1 = jax.grad(lambda x: (permute_rows(x, perm, inverse) * probe).sum())(x)
    g2 = jax.grad(lambda x: (x[perm] * probe).sum())(x)
    np.testing.assert_array_equal(g1, g2)


def test_dispatch_under_jit_gives_the_expected_sum():
    """Under jit, with tied logits: dispatch, double every row, combine gives 2 x times the
    sum of each token's weights."""
    x = jax.random.normal(jax.random.key(0), (64, 8))
    routing = JnpTopK()(
        jnp.round(jax.random.normal(jax.random.key(1), (64, 16))), None, RoutingSpec(16, 3)
    )

    def f(x):
        disp = SortDispatcher()
        d = disp.dispatch(x, routing)
        return disp.combine(d.rows * 2, d, routing)

    got = jax.jit(f)(x)
    np.testing.assert_allclose(got, 2 * x * routing.weights.sum(-1, keepdims=True), rtol=1e-6)


def test_mismatched_tokens_and_rows_are_named(unchecked):
    """The dispatcher protocol's own checks (past the tests' type checks, which would object
    first): routing for other tokens than x, and a combine of rows dispatch did not make."""
    routing = JnpTopK()(jax.random.normal(jax.random.key(0), (6, 4)), None, RoutingSpec(4, 2))
    disp = SortDispatcher()
    with pytest.raises(ValueError, match="routing has 6 tokens but x has 5"):
        unchecked(SortDispatcher.dispatch)(disp, jnp.zeros((5, 8)), routing)
    dispatched = disp.dispatch(jnp.zeros((6, 8)), routing)
    rows = dispatched.rows.shape[0]
    with pytest.raises(ValueError, match=f"combine got {rows - 1} rows, dispatch made {rows}"):
        unchecked(SortDispatcher.combine)(disp, jnp.zeros((rows - 1, 8)), dispatched, routing)


def test_a_strategy_says_whether_it_needs_a_gpu_and_an_exchange_names_its_axis():
    class Unsaid(AbstractDispatcher):
        def _dispatch(self, x, routing):
            return SortDispatcher()._dispatch(x, routing)

        def _combine(self, y_rows, dispatched, routing):
            return SortDispatcher()._combine(y_rows, dispatched, routing)

    with pytest.raises(TypeError, match="requires_gpu"):
        Unsaid()

    class NoAxis(AbstractExpertParallelDispatcher):
        requires_gpu = False
        _dispatch = Unsaid._dispatch
        _combine = Unsaid._combine

    with pytest.raises(TypeError, match="axis_name"):
        NoAxis()
    assert isinstance(AllToAllDispatcher(), AbstractExpertParallelDispatcher)
    assert not isinstance(SortDispatcher(), AbstractExpertParallelDispatcher)
