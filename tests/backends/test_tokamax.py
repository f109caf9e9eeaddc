"""tokamax's grouped matmul against the one-hot oracle: its XLA path on any machine, its Mosaic
GPU kernels under `gpu`. Skipped where tokamax is not installed (docs/backends.md says how)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from dropless.backends import BackendUnavailableError, OneHotGroupedMatmul, TokamaxGroupedMatmul
from dropless.backends._tokamax import load_tokamax

try:
    load_tokamax()
except BackendUnavailableError as err:
    pytest.skip(str(err), allow_module_level=True)

# uneven, empty and padded: 3 groups, one empty, 8 rows past the last group
SIZES = jnp.array([40, 0, 80], jnp.int32)
ROWS = 128


def _operands(in_, out, dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(k1, (ROWS, in_), dtype)
    rhs = (jax.random.normal(k2, (3, in_, out)) / in_**0.5).astype(dtype)
    probe = jax.random.normal(k3, (ROWS, out))
    return lhs, rhs, probe


def _value_and_grads(gmm, lhs, rhs, probe):
    loss = lambda a, b: jnp.sum(gmm(a, b, SIZES).astype(jnp.float32) * probe)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(lhs, rhs)


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_xla_path_equals_oracle_forward_and_gradients():
    lhs, rhs, probe = _operands(24, 20, jnp.float32)
    gmm = TokamaxGroupedMatmul(implementation="xla")
    out = jax.jit(gmm)(lhs, rhs, SIZES)
    used = int(SIZES.sum())
    np.testing.assert_allclose(
        out[:used], OneHotGroupedMatmul()(lhs, rhs, SIZES)[:used], rtol=2e-5, atol=2e-5
    )
    np.testing.assert_array_equal(out[used:], 0)  # padding rows come out as zeros
    got = _value_and_grads(gmm, lhs, rhs, probe)
    want = _value_and_grads(OneHotGroupedMatmul(), lhs, rhs, probe)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_unknown_implementation_is_named():
    with pytest.raises((ValueError, TypeCheckError), match="implementation"):
        TokamaxGroupedMatmul(implementation="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(("in_", "out"), [(256, 128), (128, 384)])
def test_mosaic_kernels_are_within_bf16_rounding_of_float32(in_, out):
    """bf16 operands, float32 oracle: output and both gradients within 1e-2 (bf16's bound),
    padding rows zero, and the same bits on a second call."""
    lhs, rhs, probe = _operands(in_, out, jnp.bfloat16, seed=in_ + out)
    gmm = TokamaxGroupedMatmul()
    out_rows = jax.jit(gmm)(lhs, rhs, SIZES)
    used = int(SIZES.sum())
    assert bool(jnp.all(out_rows[used:] == 0))
    got = _value_and_grads(gmm, lhs, rhs, probe)
    f32 = (lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    want = _value_and_grads(OneHotGroupedMatmul(), *f32, probe)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert _rel(a, b) < 1e-2
    again = _value_and_grads(gmm, lhs, rhs, probe)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
