"""Grouped-matmul strategies against the one-hot oracle, forward and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FlatWalk, grouped_matmuls
from hypothesis import given, settings
from hypothesis import strategies as st

from dropless.backends import CapacityGroupedMatmul, ChunkedGroupedMatmul, OneHotGroupedMatmul
from dropless.backends._chunked import default_chunk

ROWS, IN, OUT = 96, 24, 20
FP32 = dict(rtol=2e-5, atol=2e-5)


@st.composite
def groups(draw):
    e = draw(st.sampled_from([1, 4, 8]))
    kind = draw(st.sampled_from(["random", "one_group", "with_empty", "padded_tail"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    used = ROWS - (rng.integers(1, 30) if kind == "padded_tail" else 0)
    if kind == "one_group":
        sizes = np.zeros(e, int)
        sizes[rng.integers(e)] = used
    else:
        p = rng.dirichlet(np.ones(e) * 0.5)
        if kind == "with_empty" and e > 1:
            p[rng.integers(e)] = 0
            p = p / p.sum()
        sizes = rng.multinomial(used, p)
    return jnp.asarray(sizes, jnp.int32), seed


def _strategy_id(gmm) -> str:
    fields = ("capacity_factor", "chunk", "chunks_per_trip")
    return "-".join(
        [type(gmm).__name__] + [f"{f}={getattr(gmm, f)}" for f in fields if hasattr(gmm, f)]
    )


@pytest.mark.parametrize("gmm", grouped_matmuls())
@settings(max_examples=10)
@given(groups())
def test_equals_oracle_forward_and_gradient(gmm, g):
    sizes, seed = g
    e = sizes.shape[0]
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(k1, (ROWS, IN))
    rhs = jax.random.normal(k2, (e, IN, OUT))
    probe = jax.random.normal(k3, (ROWS, OUT))
    used = int(sizes.sum())
    mask = (jnp.arange(ROWS) < used)[:, None]  # padding rows are don't-care

    def loss(fn):
        return lambda lhs, rhs: jnp.sum(jnp.where(mask, fn(lhs, rhs, sizes), 0) * probe)

    out = jax.jit(gmm)(lhs, rhs, sizes)
    ref = OneHotGroupedMatmul()(lhs, rhs, sizes)
    np.testing.assert_allclose(out[:used], ref[:used], **FP32)
    grads = jax.jit(jax.grad(loss(gmm), argnums=(0, 1)))(lhs, rhs)
    ref_grads = jax.grad(loss(OneHotGroupedMatmul()), argnums=(0, 1))(lhs, rhs)
    for a, b in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, **FP32)


@pytest.mark.parametrize(
    "gmm",
    [
        ChunkedGroupedMatmul(),
        CapacityGroupedMatmul(),
        FlatWalk(capacity_factor=1.25, chunk=8),
    ],
    ids=_strategy_id,
)
def test_bf16_is_deterministic_and_close(gmm):
    """In bf16 (one group past its capacity slots, one empty): the output and both gradients
    keep their dtypes, repeat bit for bit, and stay within bf16 rounding of the f32 oracle."""
    sizes = jnp.array([40, 0, 56], jnp.int32)
    lhs = jax.random.normal(jax.random.key(0), (96, 32), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(1), (3, 32, 16), jnp.bfloat16)
    probe = jax.random.normal(jax.random.key(2), (96, 16))

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b, sizes).astype(jnp.float32) * probe)

    f = jax.jit(jax.value_and_grad(loss(gmm), argnums=(0, 1)))
    got = f(lhs, rhs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(f(lhs, rhs)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert got[1][0].dtype == got[1][1].dtype == jnp.bfloat16
    f32 = (lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    want = jax.value_and_grad(loss(OneHotGroupedMatmul()), argnums=(0, 1))(*f32)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a = jnp.asarray(a, jnp.float32)
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-2


def test_default_chunk_is_bounded_power_of_two():
    for rows, e in [(16, 8), (65536, 8), (4096, 64), (1 << 20, 256), (10, 1000)]:
        for per_group in (1, 4):
            c = default_chunk(rows, e, per_group)
            assert 16 <= c <= 512 and c & (c - 1) == 0
            mean = rows // e
            assert c == 16 or c == 512 or mean // per_group // 2 < c <= mean // per_group


def test_shape_mismatch_is_rejected(unchecked):
    """The strategy's own checks, past the tests' type checks (which would object first)."""
    call = unchecked(ChunkedGroupedMatmul.__call__)
    gmm = ChunkedGroupedMatmul()
    with pytest.raises(ValueError, match="lhs width 3 != rhs input width 5"):
        call(gmm, jnp.zeros((4, 3)), jnp.zeros((2, 5, 6)), jnp.array([2, 2]))
    with pytest.raises(ValueError, match="group_sizes has 3 groups, rhs has 2 experts"):
        call(gmm, jnp.zeros((4, 5)), jnp.zeros((2, 5, 6)), jnp.array([2, 1, 1]))


@pytest.mark.parametrize("gmm", [ChunkedGroupedMatmul(chunk=16), CapacityGroupedMatmul()])
def test_gradient_has_no_scatter_add(gmm):
    """The pure-jnp strategies' gradients are gathers and loops: no scatter-add (whose atomics
    make a GPU's sums run in a different order each time, and are slow there)."""
    sizes = jnp.asarray([40, 0, 50, 6], jnp.int32)  # one group overflows the capacity
    lhs, rhs = jnp.ones((ROWS, IN)), jnp.ones((4, IN, OUT))
    grad = jax.grad(lambda a, b: jnp.sum(gmm(a, b, sizes) ** 2), argnums=(0, 1))
    assert "scatter-add" not in str(jax.make_jaxpr(grad)(lhs, rhs))


def test_capacity_slot_matmuls_write_the_operand_dtype(dot_generals):
    """With bf16 operands, every batched matmul of jnp-capacity (slots forward, both gradients)
    writes bf16: a float32 result rounded afterwards costs a float32 copy of the largest
    activations."""
    sizes = jnp.asarray([40, 0, 50, 6], jnp.int32)  # one group overflows the capacity
    lhs = jnp.ones((ROWS, IN), jnp.bfloat16)
    rhs = jnp.ones((4, IN, OUT), jnp.bfloat16)
    gmm = CapacityGroupedMatmul()
    loss = lambda a, b: jnp.sum(gmm(a, b, sizes).astype(jnp.float32))
    batched = [e for e in dot_generals(loss, lhs, rhs) if e.params["dimension_numbers"][1][0]]
    assert len(batched) == 3  # the slots' forward, input gradient and weight gradient
    assert {str(e.outvars[0].aval.dtype) for e in batched} == {"bfloat16"}
