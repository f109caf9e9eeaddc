"""RMSNorm against its formula, in float32 and bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np

from dropless.nn.rmsnorm import RMSNorm


def test_matches_formula():
    x = jax.random.normal(jax.random.key(0), (3, 5, 16)) * 3.0 + 1.0
    norm = RMSNorm(16, eps=1e-5)
    norm = jax.tree.map(lambda w: w * jnp.linspace(0.5, 2.0, 16), norm)
    xn = np.asarray(x, np.float64)
    want = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-5) * np.linspace(0.5, 2.0, 16)
    np.testing.assert_allclose(norm(x), want, rtol=1e-5, atol=1e-6)


def test_bf16_input_keeps_dtype_and_uses_float32_statistics():
    # Large values: a bf16 sum of squares would be visibly off; float32 statistics are not.
    x = (jax.random.normal(jax.random.key(1), (4, 256)) * 100).astype(jnp.bfloat16)
    y = RMSNorm(256)(x)
    assert y.dtype == jnp.bfloat16
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), want, rtol=1e-2, atol=1e-2)


def test_weight_is_the_only_parameter():
    norm = RMSNorm(8, eps=1e-3)
    assert [leaf.shape for leaf in jax.tree.leaves(norm)] == [(8,)]
