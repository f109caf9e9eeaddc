"""RMSNorm against its formula, in float32 and bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np

from dropless.nn import RMSNorm


def test_matches_formula():
    x = jax.random.normal(jax.random.key(0), (3, 5, 16)) * 3.0 + 1.0
    norm = RMSNorm(16, eps=1e-5)
    norm = jax.tree.map(lambda w: w * jnp.linspace(0.5, 2.0, 16), norm)
    xn = np.asarray(x, np.float64)
    want = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-5) * np.linspace(0.5, 2.0, 16)
    np.testing.assert_allclose(norm(x), want, rtol=1e-5, atol=1e-6)


def test_bf16_input_keeps_dtype_and_uses_float32_statistics():
    """A bf16 input comes back in bf16, equal to the exact result rounded to bf16. Statistics
    taken in bf16 round the row's scale to 8 bits, and about half the elements then round to
    a neighbouring bf16 value (0.55 equal, measured), so the test asks for 99% equal and no
    element more than one bf16 spacing off."""
    x = (jax.random.normal(jax.random.key(1), (4, 256)) * 100).astype(jnp.bfloat16)
    y = RMSNorm(256)(x)
    assert y.dtype == jnp.bfloat16
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)
    want = jnp.asarray(want, jnp.float32).astype(jnp.bfloat16)
    assert float((y == want).mean()) >= 0.99
    spacing = 2.0 ** (np.floor(np.log2(np.abs(np.asarray(want, np.float32)))) - 7)
    assert (np.abs(np.asarray(y, np.float32) - np.asarray(want, np.float32)) <= spacing).all()


def test_weight_is_the_only_parameter():
    norm = RMSNorm(8, eps=1e-3)
    assert [leaf.shape for leaf in jax.tree.leaves(norm)] == [(8,)]
