"""The pure-jnp backend's hand-written pieces against plain jnp (autodiff of the obvious code)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.backends import CapacityGroupedMatmul, ChunkedGroupedMatmul, OneHotGroupedMatmul
from dropless.backends import _capacity as capacity
from dropless.backends import _sort as sort
from dropless.backends._chunked import (
    _chunked_weight_grad,
    add_row_chunks,
    chunked_grouped_matmul,
    group_tails,
)
from dropless.backends._sort import _sort_by_expert, combine_rows, expand_rows, sum_copies

FP32 = dict(rtol=2e-5, atol=2e-5)


def plan(tokens, k, experts, seed):
    ids = jax.random.randint(jax.random.key(seed), (tokens * k,), 0, experts)
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    return ids, order, jnp.argsort(order).astype(jnp.int32)


@pytest.mark.parametrize("experts", [1, 3, 16])
def test_sort_by_expert_is_the_stable_argsort(experts):
    ids, order, _ = plan(50, 4, experts, seed=experts)
    np.testing.assert_array_equal(_sort_by_expert(ids, experts), order)
    # experts * copies past int32: the (id, index) pair sort
    np.testing.assert_array_equal(_sort_by_expert(ids, 2**31), order)


@pytest.mark.parametrize("dim", [7, 12, 48])  # 1, 4 and 16 column blocks in combine's backward
def test_expand_and_combine_match_plain_gathers(dim):
    tokens, k = 9, 3
    _, order, inverse = plan(tokens, k, 5, seed=dim)
    keys = jax.random.split(jax.random.key(dim), 4)
    x = jax.random.normal(keys[0], (tokens, dim))
    weights = jax.random.uniform(keys[1], (tokens, k))
    scale = jax.random.normal(keys[2], (tokens * k, dim))  # stands in for the experts
    probe = jax.random.normal(keys[3], (tokens, dim))

    def ours(x, weights):
        rows = expand_rows(x, order, inverse) * scale
        return combine_rows(rows, weights, order, inverse)

    def plain(x, weights):
        rows = x[order // k] * scale
        return jnp.einsum("tkd,tk->td", rows[inverse].reshape(tokens, k, dim), weights)

    np.testing.assert_allclose(ours(x, weights), plain(x, weights), **FP32)
    grads = [
        jax.grad(lambda *a, f=f: jnp.sum(f(*a) * probe), argnums=(0, 1))(x, weights)
        for f in (ours, plain)
    ]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(a, b, **FP32)


def test_sum_copies_is_combine_with_weights_of_one_and_keeps_no_rows():
    """`sum_copies` equals `combine_rows` with every weight 1, in value and in the rows'
    gradient, and its backward keeps only the permutation (no `[copies dim]` rows)."""
    tokens, k, dim = 9, 3, 12
    _, order, inverse = plan(tokens, k, 5, seed=1)
    rows = jax.random.normal(jax.random.key(2), (tokens * k, dim))
    probe = jax.random.normal(jax.random.key(3), (tokens, dim))
    ones = jnp.ones((tokens, k))
    ours, vjp = jax.vjp(lambda r: sum_copies(r, order, inverse, k), rows)
    want, want_vjp = jax.vjp(lambda r: combine_rows(r, ones, order, inverse), rows)
    np.testing.assert_allclose(ours, want, **FP32)
    np.testing.assert_allclose(vjp(probe)[0], want_vjp(probe)[0], **FP32)
    kept = [leaf.shape for leaf in jax.tree.leaves(vjp)]
    assert (tokens * k, dim) not in kept and (tokens * k,) in kept


def test_bf16_combine_sums_in_float32_and_gathers_its_cotangent_in_bf16():
    """Against the float32 sum cast afterwards (autodiff's gradient): the same output and row
    gradient bitwise, and no float32 copy of the cotangent per row in the backward."""
    tokens, k, dim = 9, 3, 16
    _, order, inverse = plan(tokens, k, 5, seed=1)
    keys = jax.random.split(jax.random.key(1), 3)
    rows = jax.random.normal(keys[0], (tokens * k, dim), jnp.bfloat16)
    weights = jax.random.uniform(keys[1], (tokens, k))
    probe = jax.random.normal(keys[2], (tokens, dim))

    def ours(rows, weights):
        return combine_rows(rows, weights, order, inverse)

    def cast_after(rows, weights):
        summed = jnp.einsum("tkd,tk->td", rows[inverse].reshape(tokens, k, dim), weights)
        return summed.astype(rows.dtype)

    def loss(f):
        return lambda *a: jnp.sum(f(*a).astype(jnp.float32) * probe)

    out = ours(rows, weights)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, cast_after(rows, weights))
    (d_rows, d_w), (want_rows, want_w) = (
        jax.grad(loss(f), argnums=(0, 1))(rows, weights) for f in (ours, cast_after)
    )
    np.testing.assert_array_equal(d_rows, want_rows)
    np.testing.assert_allclose(d_w, want_w, **FP32)
    jaxpr = jax.make_jaxpr(jax.grad(loss(ours), argnums=(0, 1)))(rows, weights)
    gathered = [
        eqn.outvars[0].aval.dtype
        for eqn in jaxpr.jaxpr.eqns
        if eqn.primitive.name == "gather" and eqn.outvars[0].aval.shape == (tokens * k, dim)
    ]
    assert gathered and all(dtype == jnp.bfloat16 for dtype in gathered)


@pytest.mark.parametrize("slot_share", [0.5, 1.0])  # 8 or 16 slots (the CPU's, the default's)
@pytest.mark.parametrize("chunk", [4, 8])  # groups of 3 chunks on average: a loop; of 1.5: slots
@pytest.mark.parametrize(
    "sizes",
    [[12, 12, 12, 12], [48, 0, 0, 0], [0, 30, 1, 17], [3, 9, 0, 20]],  # the last leaves 16 padding
    ids=["balanced", "one_group", "with_empty", "padded_tail"],
)
def test_weight_grad_matches_per_expert_sum(sizes, chunk, slot_share):
    """Groups within, past and far past the batched slots (with chunk=8), empty groups, and
    unused trailing rows."""
    rows, n_in, n_out = 48, 6, 5
    sizes = jnp.asarray(sizes, jnp.int32)
    lhs = jax.random.normal(jax.random.key(0), (rows, n_in))
    g = jax.random.normal(jax.random.key(1), (rows, n_out))
    got = _chunked_weight_grad(lhs, g, sizes, chunk, 4, lhs.dtype, slot_share)
    ends = np.cumsum(sizes)
    want = np.stack(
        [
            lhs[end - n : end].T @ g[end - n : end]
            for n, end in zip(np.asarray(sizes), ends, strict=True)
        ]
    )
    np.testing.assert_allclose(got, want, **FP32)


@pytest.mark.parametrize("platform, slots", [("cpu", 8), ("cuda", 16)])
def test_weight_grad_slots_are_half_the_mean_group_on_the_cpu(platform, slots):
    """The gradient lowered for each platform gathers its slots as [experts slots in_]: half
    the mean group of 12 (rounded up to 8) on the CPU, the whole mean (16) elsewhere."""
    rows, n_in, n_out, experts = 48, 6, 5, 4
    sizes = jnp.full((experts,), rows // experts, jnp.int32)
    grad = jax.jit(jax.grad(lambda a, b: chunked_grouped_matmul(a, b, sizes, 8).sum(), argnums=1))
    lowered = grad.trace(jnp.ones((rows, n_in)), jnp.ones((experts, n_in, n_out))).lower(
        lowering_platforms=(platform,)
    )
    gathered = {n for n in (8, 16) if f"tensor<{experts}x{n}x{n_in}xf32>" in lowered.as_text()}
    assert gathered == {slots}


# per_trip: nested loops, one chunk per trip of a flat loop, 3 per trip (spare places in the last)
@pytest.mark.parametrize("per_trip", [None, 1, 3])
@pytest.mark.parametrize("chunk", [4, 64])  # several chunks per segment; one wider than all rows
def test_overflow_rows_are_added_in_place(chunk, per_trip):
    """The capacity strategy's weight gradient: rows past each group's first `skip` are added
    to the slots' gradient, and experts without such rows keep theirs untouched."""
    rows, n_in, n_out, skip = 48, 6, 5, 5
    sizes = jnp.asarray([0, 30, 1, 17], jnp.int32)
    lhs = jax.random.normal(jax.random.key(0), (rows, n_in))
    g = jax.random.normal(jax.random.key(1), (rows, n_out))
    base = jax.random.normal(jax.random.key(2), (4, n_in, n_out))
    starts, counts = group_tails(sizes, skip)
    got = add_row_chunks(base, lhs, g, starts, counts, chunk, per_trip)
    ends = np.cumsum(sizes)
    past = [
        slice(end - n + min(skip, n), end) for n, end in zip(np.asarray(sizes), ends, strict=True)
    ]
    want = base + np.stack([lhs[p].T @ g[p] for p in past])
    np.testing.assert_allclose(got, want, **FP32)
    np.testing.assert_array_equal(got[0], base[0])  # an empty group
    np.testing.assert_array_equal(got[2], base[2])  # one row, inside the first `skip`


def test_chunked_matmul_with_fewer_rows_than_a_chunk():
    """Chunk windows are clamped into the buffer rather than padded past it."""
    sizes = jnp.asarray([4, 0, 5], jnp.int32)  # and one trailing unused row
    lhs = jax.random.normal(jax.random.key(0), (10, 6))
    rhs = jax.random.normal(jax.random.key(1), (3, 6, 5))
    probe = jax.random.normal(jax.random.key(2), (10, 5))
    results = [
        (
            gmm(lhs, rhs, sizes),
            jax.grad(lambda a, b, f=gmm: jnp.sum(f(a, b, sizes) * probe), (0, 1))(lhs, rhs),
        )
        for gmm in (ChunkedGroupedMatmul(chunk=16), OneHotGroupedMatmul())
    ]
    for a, b in zip(*[jax.tree.leaves(r) for r in results], strict=True):
        np.testing.assert_allclose(a, b, **FP32)


@pytest.mark.parametrize("make", [ChunkedGroupedMatmul, CapacityGroupedMatmul])
@pytest.mark.parametrize("bad", [0, -2, True])
def test_chunk_must_be_a_positive_int(make, bad):
    with pytest.raises(ValueError, match=rf"chunk \({bad!r}\) must be None or an int >= 1"):
        make(chunk=bad)
    assert make(chunk=None).chunk is None and make(chunk=3).chunk == 3


def test_overflow_walk_is_nested_on_the_cpu_and_flat_on_accelerators(monkeypatch):
    walks = []
    real = capacity.capacity_grouped_matmul
    spy = lambda *args: walks.append(args[-1]) or real(*args)  # noqa: E731
    monkeypatch.setattr(capacity, "capacity_grouped_matmul", spy)
    lhs, rhs = jnp.ones((16, 8)), jnp.ones((2, 8, 4))
    sizes = jnp.asarray([16, 0], jnp.int32)  # expert 0 overflows its slots
    for platform in ("cpu", "gpu"):
        monkeypatch.setattr(jax, "default_backend", lambda p=platform: p)
        out = CapacityGroupedMatmul()(lhs, rhs, sizes)
        np.testing.assert_allclose(out, 8.0)
    assert walks == [None, 4]


@pytest.mark.parametrize("per_trip", [None, 2])
def test_overflow_weight_grad_ignores_other_experts_rows(per_trip):
    """A chunk window may cover rows of the next expert: an inf gradient there must not reach
    this expert's weight gradient (0 * inf would be NaN)."""
    sizes = jnp.asarray([12, 12], jnp.int32)
    lhs = jnp.ones((24, 3))
    g = jnp.ones((24, 2)).at[13].set(jnp.inf)  # a row of expert 1
    starts, counts = group_tails(sizes, 4)  # expert 0's rows 4..11: one 8-row chunk
    got = add_row_chunks(jnp.zeros((2, 3, 2)), lhs, g, starts, counts, 10, per_trip)
    np.testing.assert_array_equal(got[0], np.full((3, 2), 8.0))


def test_weights_grad_by_row_equals_by_token():
    """The combine's weights gradient in its two forms (by row elsewhere, by token on the CPU)
    agrees to float32 rounding of the largest value; `_weights_grad` is by token on the CPU."""
    tokens, k, dim = 11, 3, 64
    _, order, inverse = plan(tokens, k, 5, seed=2)
    keys = jax.random.split(jax.random.key(2), 2)
    rows = jax.random.normal(keys[0], (tokens * k, dim), jnp.bfloat16)
    dy = jax.random.normal(keys[1], (tokens, dim), jnp.bfloat16)
    f32 = np.asarray(rows, np.float32), np.asarray(dy, np.float32)
    want = np.array(
        [[f32[0][inverse[t * k + j]] @ f32[1][t] for j in range(k)] for t in range(tokens)]
    )
    dy_rows = dy[order // k]
    by_row = sort._weights_grad_by_row(rows, dy, dy_rows, inverse, k)
    by_token = sort._weights_grad_by_token(rows, dy, dy_rows, inverse, k)
    for got in (by_row, by_token):
        assert got.shape == (tokens, k)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    chosen = by_token if jax.default_backend() == "cpu" else by_row
    np.testing.assert_array_equal(sort._weights_grad(rows, dy, dy_rows, inverse, k), chosen)
