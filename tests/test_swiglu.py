"""The dense SwiGLU and its gate-and-up matmul on side-by-side weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import SwiGLU, swiglu
from dropless._swiglu import gate_up, swiglu_grad_in_blocks

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


@pytest.mark.parametrize("block", [3, 12])  # interleaved in blocks; all gate then all up
def test_swiglu_grad_in_blocks_equals_autodiff(block):
    """The one-pass SwiGLU gradient in a blocked layout, with a row scale, against jax.vjp of
    the same function written on the separate halves: both inputs' gradients in the layout,
    and the scale's."""
    keys = jax.random.split(jax.random.key(4), 3)
    gate_and_up = 3.0 * jax.random.normal(keys[0], (5, 24))
    d_hidden = jax.random.normal(keys[1], (5, 12))
    scale = jax.random.uniform(keys[2], (5,), minval=0.1, maxval=2.0)

    def blocked(x):  # [rows 24] -> gate [rows 12], up [rows 12]
        pairs = x.reshape(5, 12 // block, 2, block)
        return pairs[:, :, 0].reshape(5, 12), pairs[:, :, 1].reshape(5, 12)

    def f(x, s):
        gate, up = blocked(x)
        return jax.nn.silu(gate) * up * s[:, None]

    _, vjp = jax.vjp(f, gate_and_up, scale)
    want_x, want_s = vjp(d_hidden)
    got_x, got_s = swiglu_grad_in_blocks(gate_and_up, d_hidden, block, scale)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_s, want_s, rtol=1e-5, atol=1e-5)
    unscaled, none = swiglu_grad_in_blocks(gate_and_up, d_hidden, block)
    _, vjp = jax.vjp(lambda x: f(x, jnp.ones(5)), gate_and_up)
    np.testing.assert_allclose(unscaled, vjp(d_hidden)[0], rtol=1e-5, atol=1e-6)
    assert none is None
