import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless import JnpTopK, Routing, RoutingSpec
from dropless import _balance as balance


def make_routing(ids, scores):
    ids = jnp.asarray(ids, jnp.int32)
    scores = jnp.asarray(scores, jnp.float32)
    w = jnp.take_along_axis(scores, ids, -1)
    return Routing(expert_ids=ids, weights=w, scores=scores, logits=jnp.log(scores))


def test_counts_and_maxvio():
    counts = balance.tokens_per_expert(jnp.array([[0, 1], [0, 2], [0, 1]]), 4)
    np.testing.assert_array_equal(counts, [3, 2, 1, 0])
    np.testing.assert_allclose(balance.max_violation(counts), 3 / 1.5 - 1)
    np.testing.assert_allclose(balance.max_violation(jnp.ones(8) * 5), 0.0)


def _by_scatter(ids, n_experts):
    return balance._count_by_scatter(ids.reshape(-1).astype(jnp.int32), n_experts)


def _by_compare(ids, n_experts):
    return balance._count_by_compare(ids.reshape(-1).astype(jnp.int32), n_experts)


# the CPU's way, the accelerators' way, and the public function (the CPU's here)
METHODS = [_by_scatter, _by_compare, balance.expert_counts]


@given(
    st.lists(st.integers(0, 63), min_size=1, max_size=300),
    st.sampled_from([1, 2, 3]),
    st.sampled_from(METHODS),
)
def test_expert_counts_equal_numpy_bincount_by_either_method(ids, k, method):
    """Short lists put all copies on a few experts and leave most empty."""
    ids = np.resize(np.asarray(ids, np.int32), (len(ids), k))
    counts = method(jnp.asarray(ids), 64)
    assert counts.dtype == jnp.int32
    np.testing.assert_array_equal(counts, np.bincount(ids.reshape(-1), minlength=64))


@pytest.mark.parametrize("method", METHODS)
def test_expert_counts_drop_ids_out_of_range_and_take_narrow_int_ids(method):
    ids = jnp.asarray([-1, 0, 3, 4, 9, -7, 3], jnp.int32)
    np.testing.assert_array_equal(method(ids, 4), [1, 0, 0, 2])
    # int8 ids with more experts than int8 holds: no expert id may wrap onto a small one
    narrow = jnp.asarray([1, 2, 100], jnp.int8)
    want = np.zeros(300, np.int32)
    want[[1, 2, 100]] = 1
    np.testing.assert_array_equal(method(narrow, 300), want)


def test_expert_counts_auto_scatters_on_the_cpu_and_compares_on_a_gpu(lowered):
    """The choice is made where the count is lowered, not by the default device: lowered for
    the CPU a scatter-add, for CUDA none (checked on this machine, no GPU needed)."""
    ids = jax.ShapeDtypeStruct((1000,), jnp.int32)

    def count(ids):
        return balance.expert_counts(ids, 64)

    assert "scatter" in lowered(count, ids, platform="cpu")
    assert "scatter" not in lowered(count, ids, platform="cuda")


def test_balance_losses_are_one_when_balanced_and_larger_when_not():
    e = 4
    uniform = jnp.full((8, e), 1 / e)
    balanced = make_routing(jnp.arange(8)[:, None] % e, uniform)
    np.testing.assert_allclose(balance.batch_balance_loss(balanced), 1.0, rtol=1e-6)
    np.testing.assert_allclose(balance.sequence_balance_loss(balanced, 4), 1.0, rtol=1e-6)
    skew_scores = jnp.tile(jnp.array([0.7, 0.1, 0.1, 0.1]), (8, 1))
    skewed = make_routing(jnp.zeros((8, 1), int), skew_scores)
    # f = [4, 0, 0, 0], P = [0.7, ...] -> 4 * 0.7
    np.testing.assert_allclose(balance.batch_balance_loss(skewed), 2.8, rtol=1e-6)


def test_sequence_loss_sees_imbalance_within_sequences():
    # Each sequence all on one expert, but the batch as a whole balanced.
    e = 2
    ids = jnp.array([[0], [0], [1], [1]])
    scores = jnp.array([[0.9, 0.1], [0.9, 0.1], [0.1, 0.9], [0.1, 0.9]])
    r = make_routing(ids, scores)
    assert balance.sequence_balance_loss(r, 2) > balance.batch_balance_loss(r) + 0.5
    with pytest.raises(ValueError, match="seq_len"):
        balance.sequence_balance_loss(r, 3)
    del e


def test_z_loss_formula():
    logits = jax.random.normal(jax.random.key(0), (6, 5))
    expected = np.mean(np.log(np.exp(np.asarray(logits)).sum(-1)) ** 2)
    np.testing.assert_allclose(balance.router_z_loss(logits), expected, rtol=1e-5)


def test_bias_update_sign_rule_and_no_gradient():
    bias = jnp.zeros((2, 4))
    counts = jnp.array([[4.0, 0, 2, 2], [1, 1, 1, 1]])
    new = balance.update_expert_bias(bias, counts, 0.1)
    np.testing.assert_allclose(new, [[-0.1, 0.1, 0, 0], [0, 0, 0, 0]])
    g = jax.grad(lambda b: balance.update_expert_bias(b, counts, 0.1).sum())(bias)
    np.testing.assert_array_equal(g, 0.0)


def test_bias_update_moves_load_toward_uniform():
    spec = RoutingSpec(16, 2, "sigmoid", use_expert_bias=True)
    # Skewed affinities: a few experts are preferred by most tokens.
    key = jax.random.key(3)
    logits = jax.random.normal(key, (512, 16)) + jnp.linspace(2.0, -2.0, 16)
    bias = jnp.zeros(16)
    topk = jax.jit(JnpTopK(), static_argnums=2)
    start = None
    for _ in range(200):
        counts = balance.tokens_per_expert(topk(logits, bias, spec).expert_ids, 16)
        vio = float(balance.max_violation(counts))
        start = vio if start is None else start
        bias = balance.update_expert_bias(bias, counts, 0.01)
    assert start > 1.0
    assert vio < 0.35 * start


@given(
    st.lists(st.integers(0, 7), min_size=8, max_size=64),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 2**31 - 1),
)
def test_global_loss_over_slices_is_the_batch_loss_of_their_union(ids, slices, seed):
    """The global-batch loss: with every slice given the union's counts, the mean over equal
    slices equals the batch-wise loss of all the tokens at once (values and gradients)."""
    n = len(ids) // slices * slices
    ids = jnp.asarray(np.resize(np.asarray(ids, np.int32), (n, 2)))
    logits = jax.random.normal(jax.random.key(seed), (n, 8))
    (got, got_grad), (want, want_grad) = _slices_and_whole(ids, logits, slices)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-6)


# Compiled, one program per token count and slice count: op by op, each example's new shape
# compiles every primitive of both losses and their gradients apart, 4x slower.
@functools.partial(jax.jit, static_argnums=2)
def _slices_and_whole(ids, logits, slices):
    """(value, gradient) w.r.t. the logits of the mean of the slices' global-batch losses, and
    of the batch-wise loss of all the tokens."""

    def whole(logits):
        return balance.batch_balance_loss(make_routing(ids, jax.nn.softmax(logits)))

    def by_slices(logits):
        counts = balance.tokens_per_expert(ids, 8)
        parts = [
            balance.global_balance_loss(balance.router_probability(jax.nn.softmax(lg)), counts)
            for lg in jnp.split(logits, slices)
        ]
        return jnp.mean(jnp.stack(parts))

    return jax.value_and_grad(by_slices)(logits), jax.value_and_grad(whole)(logits)


@given(st.integers(0, 2**31 - 1), st.sampled_from([2, 5, 16]))
def test_router_entropy_equals_numpy_and_is_bounded(seed, n_experts):
    scores = jax.nn.softmax(3 * jax.random.normal(jax.random.key(seed), (6, n_experts)))
    p = np.asarray(scores, np.float64)
    want = -np.mean(np.sum(p * np.log(np.maximum(p, 1e-300)), -1))
    got = balance.router_entropy(scores)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert -1e-6 <= float(got) <= np.log(n_experts) + 1e-5
    uniform = balance.router_entropy(jnp.ones((3, n_experts)))
    np.testing.assert_allclose(uniform, np.log(n_experts), rtol=1e-6)  # float32 rounding
    one_hot = jax.nn.one_hot(jnp.arange(3) % n_experts, n_experts)
    assert float(balance.router_entropy(one_hot)) == 0.0


@given(st.lists(st.permutations(range(6)), min_size=1, max_size=20), st.sampled_from([1, 2, 3]))
def test_coselection_counts_pairs_directly(perms, k):
    ids = np.asarray([p[:k] for p in perms], np.int32)
    got = np.asarray(balance.coselection(jnp.asarray(ids), 6))
    want = np.zeros((6, 6), np.int64)
    for row in ids:
        for i in row:
            for j in row:
                want[i, j] += 1
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, got.T)
    np.testing.assert_array_equal(np.diag(got), np.bincount(ids.reshape(-1), minlength=6))


def test_dead_experts_are_those_never_chosen_over_the_steps():
    loads = jnp.asarray([[[0, 3, 0, 1], [2, 0, 0, 0]], [[0, 0, 0, 5], [1, 1, 1, 0]]])
    # layer 0: experts 0 and 2 never chosen; layer 1: expert 3 never chosen
    np.testing.assert_array_equal(balance.dead_experts(loads), [2, 1])
