"""The row-gather kernel (interpreted on the CPU, compiled on a GPU) against XLA's gathers, and
the dispatcher that uses it against `SortDispatcher` in a MoE layer."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.backends import Backend, with_backend
from dropless.backends.jnp import CapacityGroupedMatmul, SortDispatcher
from dropless.backends.row_gather import (
    BLOCK_ROWS,
    PallasSortDispatcher,
    column_block,
    gather_rows,
)
from dropless.moe import MoE
from dropless.routing import JnpTopK, RoutingSpec

F32 = jnp.float32


def test_column_block_is_a_power_of_two_dividing_the_width():
    assert [column_block(d) for d in (1024, 2048, 7168, 96, 12)] == [1024, 1024, 1024, 32, 4]


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "dtype, dim", [(jnp.bfloat16, 128), (jnp.float32, 128), (jnp.bfloat16, 96)]
)
def test_gather_rows_equals_xla(dtype, dim, interpret):
    """dim 96: three programs of 32 columns per row block (7168: seven of 1024), the dot products
    summed over them."""
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (24, dim), dtype)
    index = jax.random.randint(keys[1], (2 * BLOCK_ROWS,), 0, 24)
    scale = jax.random.uniform(keys[2], index.shape)
    other = jax.random.normal(keys[3], (index.shape[0], dim), dtype)

    np.testing.assert_array_equal(gather_rows(x, index, interpret=interpret), x[index])
    scaled, dots = gather_rows(x, index, scale, dot_with=other, interpret=interpret)
    assert scaled.dtype == dtype and dots.dtype == F32
    want = (x[index].astype(F32) * scale[:, None]).astype(dtype)
    np.testing.assert_array_equal(np.asarray(scaled, F32), np.asarray(want, F32))
    want_dots = jnp.sum(x[index].astype(F32) * other.astype(F32), axis=1)
    # float32 products summed in another order than XLA's: a few ulps of the largest
    np.testing.assert_allclose(dots, want_dots, rtol=0, atol=1e-6 * jnp.abs(want_dots).max())


def test_gather_rows_rejects_a_partial_block():
    x = jnp.zeros((4, 128))
    with pytest.raises(ValueError, match="not a multiple of BLOCK_ROWS"):
        gather_rows(x, jnp.zeros(BLOCK_ROWS + 1, jnp.int32), interpret=True)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(
    "tokens, interpret",
    [
        (16, True),  # 32 copies: the kernel
        (20, True),  # 40 copies: XLA's gathers
        pytest.param(16, False, marks=pytest.mark.gpu),
        pytest.param(1024, False, marks=pytest.mark.gpu),
    ],
)
def test_dispatcher_equals_sort_dispatcher(tokens, interpret, fused):
    spec = RoutingSpec(8, 2, "sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5)
    k_model, k_x, k_probe = jax.random.split(jax.random.key(3), 3)
    reference = MoE(128, 64, spec, n_shared_experts=1, key=k_model)
    reference = with_backend(
        reference, Backend(SortDispatcher(), CapacityGroupedMatmul(), JnpTopK())
    )
    kernel = with_backend(
        reference,
        Backend(
            PallasSortDispatcher(interpret=interpret, fused_combine_backward=fused),
            CapacityGroupedMatmul(),
            JnpTopK(),
        ),
    )
    assert isinstance(kernel.dispatcher, PallasSortDispatcher)
    x = jax.random.normal(k_x, (tokens, 128), jnp.bfloat16)
    probe = jax.random.normal(k_probe, (tokens, 128))

    def loss(moe, x):
        return jnp.sum(moe(x)[0].astype(F32) * probe)

    value_and_grads = eqx.filter_jit(jax.value_and_grad(loss, argnums=(0, 1)))
    for a, b in zip(
        jax.tree.leaves(value_and_grads(kernel, x)),
        jax.tree.leaves(value_and_grads(reference, x)),
        strict=True,
    ):
        # the routing weights' gradient sums in another order, and the router's gradient sums
        # it over tokens with cancellation: bound by the largest value, not each element's
        a, b = np.asarray(a, F32), np.asarray(b, F32)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


@pytest.mark.parametrize("fused, kernels", [(False, 1), (True, 2)])
def test_combine_backward_uses_the_kernel_only_when_fused(fused, kernels):
    """The expansion always goes through the kernel; the combine's backward only on request."""
    spec = RoutingSpec(8, 2, "softmax")
    moe = MoE(128, 64, spec, key=jax.random.key(0))
    dispatcher = PallasSortDispatcher(interpret=True, fused_combine_backward=fused)
    moe = with_backend(moe, Backend(dispatcher, CapacityGroupedMatmul(), JnpTopK()))
    x = jnp.ones((16, 128))
    grad = jax.grad(lambda x: jnp.sum(moe(x)[0]))
    assert str(jax.make_jaxpr(grad)(x)).count("pallas_call") == kernels
