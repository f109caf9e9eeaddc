"""The row-gather kernel (interpreted on the CPU, compiled on a GPU) against XLA's gathers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.backends.row_gather import (
    BLOCK_ROWS,
    column_block,
    gather_rows,
)

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
