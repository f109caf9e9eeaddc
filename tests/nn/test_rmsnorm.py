"""RMSNorm against its formula, in float32 and bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.nn.rmsnorm import RMSNorm, rms_norm


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


def _autodiff_norm(x, weight, eps):
    """The formula, differentiated by JAX: what rms_norm's hand-written backward must equal."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * normed).astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_equals_autodiff(dtype):
    keys = jax.random.split(jax.random.key(4), 3)
    x = (jax.random.normal(keys[0], (3, 4, 32)) * 2 + 0.5).astype(dtype)
    weight = jax.random.uniform(keys[1], (32,), minval=0.5, maxval=2.0)
    cotangent = jax.random.normal(keys[2], (3, 4, 32)).astype(dtype)

    def vjp(norm):
        y, pullback = jax.vjp(lambda x, w: norm(x, w, 1e-5), x, weight)
        return y, *pullback(cotangent)

    got, want = vjp(rms_norm), vjp(_autodiff_norm)
    # float32: the same arithmetic reordered. bf16: dx is rounded to bf16 from float32 in
    # ours, from bf16 arithmetic in autodiff's, so they may differ by a bf16 ulp or two.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def test_backward_keeps_x_and_one_number_per_row():
    """Only x (in its own dtype) and a float32 [rows 1] are kept for the backward (besides
    the weight): no float32 copy of x and no normalised x."""
    from jax._src.ad_checkpoint import saved_residuals

    x = jnp.ones((6, 64), jnp.bfloat16)
    weight = jnp.ones((64,))
    kept = [
        (aval.shape, aval.dtype)
        for aval, why in saved_residuals(lambda x, w: rms_norm(x, w, 1e-6), x, weight)
        if "from the argument" not in why
    ]
    assert kept == [((6, 1), jnp.float32)]
