"""The dense SwiGLU and its gate-and-up matmul on side-by-side weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.nn.mlp import SwiGLU, gate_up, swiglu

FP32 = dict(rtol=2e-5, atol=2e-5)


def test_swiglu_is_the_formula_on_separate_weights():
    mlp = SwiGLU(8, 6, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (3, 5, 8))
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    xs = np.asarray(x, np.float64)
    w = {name: np.asarray(getattr(mlp, name), np.float64) for name in ("w_gate", "w_up", "w_down")}
    want = (silu(xs @ w["w_gate"]) * (xs @ w["w_up"])) @ w["w_down"]
    np.testing.assert_allclose(mlp(x), want, **FP32)


def test_gate_up_puts_gate_columns_first_and_casts():
    gate = jax.random.normal(jax.random.key(0), (4, 8, 6))
    up = jax.random.normal(jax.random.key(1), (4, 8, 6))
    both = gate_up(gate, up, jnp.bfloat16)
    assert both.shape == (4, 8, 12) and both.dtype == jnp.bfloat16
    np.testing.assert_array_equal(both[..., :6], gate.astype(jnp.bfloat16))
    np.testing.assert_array_equal(both[..., 6:], up.astype(jnp.bfloat16))
    h = jax.random.normal(jax.random.key(2), (5, 12))
    np.testing.assert_array_equal(swiglu(h), jax.nn.silu(h[:, :6]) * h[:, 6:])


def test_x_meets_one_matmul_forward_and_backward(dot_generals):
    """Gate and up are one matmul, so x's gradient is one matmul too (no sum of two)."""
    mlp = SwiGLU(8, 6, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 8))
    jaxpr = jax.make_jaxpr(lambda x: mlp(x))(x).jaxpr
    assert sum(jaxpr.invars[0] in eqn.invars for eqn in jaxpr.eqns) == 1
    # The gradient w.r.t. x alone (w is a dummy): 2 matmuls forward, 2 backward (separate
    # gate and up weights would take 3 and 3).
    assert len(dot_generals(lambda x, w: mlp(x).sum() + 0 * w, x, 1.0)) == 4


def _autodiff_swiglu(gate_and_up):
    gate, up = jnp.split(gate_and_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_gradient_equals_autodiff(dtype):
    keys = jax.random.split(jax.random.key(5), 2)
    h = (3 * jax.random.normal(keys[0], (7, 24))).astype(dtype)
    cotangent = jax.random.normal(keys[1], (7, 12)).astype(dtype)
    got_y, pullback = jax.vjp(swiglu, h)
    want_y, want_pullback = jax.vjp(_autodiff_swiglu, h)
    (got,), (want,) = pullback(cotangent), want_pullback(cotangent)
    np.testing.assert_array_equal(got_y, want_y)
    assert got.dtype == want.dtype == dtype
    # float32: the same formula; bf16: ours rounds once from float32, autodiff's computes in
    # bf16, so the two differ by bf16 rounding (relative 2**-8 per operation).
    tol = FP32 if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


def test_swiglu_backward_keeps_only_its_input():
    from jax._src.ad_checkpoint import saved_residuals

    h = jnp.ones((7, 24), jnp.bfloat16)
    kept = [aval.shape for aval, _ in saved_residuals(swiglu, h)]
    assert kept == [(7, 24)]
