"""Grouped SwiGLU experts: the formula per expert, and gate and up as one grouped matmul."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import AbstractGroupedMatmul, GroupedExperts, swiglu
from dropless._experts import swiglu_scaled
from dropless.backends import ChunkedGroupedMatmul

FP32 = dict(rtol=2e-5, atol=2e-5)


class RecordingMatmul(AbstractGroupedMatmul):
    """`ChunkedGroupedMatmul` that records the weight shape of every call (at trace time)."""

    requires_gpu = False

    inner: ChunkedGroupedMatmul

    def _impl(self, lhs, rhs, group_sizes):
        recorded.append(rhs.shape)
        return self.inner(lhs, rhs, group_sizes)


recorded: list[tuple[int, ...]] = []  # weight shapes, in call order


def test_each_row_gets_its_experts_swiglu_from_two_grouped_matmuls():
    experts, dim, hidden = 4, 8, 6
    ex = GroupedExperts(
        experts,
        dim,
        hidden,
        gmm=RecordingMatmul(ChunkedGroupedMatmul(chunk=4)),
        key=jax.random.key(0),
    )
    sizes = np.array([3, 0, 5, 2])
    rows = jax.random.normal(jax.random.key(1), (int(sizes.sum()), dim))
    recorded.clear()
    got = ex(rows, jnp.asarray(sizes, jnp.int32))
    # Gate and up side by side in one call, then the down projection.
    assert recorded == [(experts, dim, 2 * hidden), (experts, hidden, dim)]
    owner = np.repeat(np.arange(experts), sizes)
    w = {n: np.asarray(getattr(ex, n), np.float64) for n in ("w_gate", "w_up", "w_down")}
    x = np.asarray(rows, np.float64)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    want = np.stack(
        [
            (silu(x[r] @ w["w_gate"][e]) * (x[r] @ w["w_up"][e])) @ w["w_down"][e]
            for r, e in enumerate(owner)
        ]
    )
    np.testing.assert_allclose(got, want, **FP32)


def test_swiglu_scaled_values_gradients_and_residuals():
    """`swiglu_scaled` equals autodiff of `swiglu(x) * scale` with float32 inputs (gate and up
    swapped would fail), and its backward keeps only its inputs: no `[rows hidden]` array."""
    keys = jax.random.split(jax.random.key(1), 3)
    gate_and_up = 2.0 * jax.random.normal(keys[0], (24, 16))
    scale = jax.random.uniform(keys[1], (24,))
    g = jax.random.normal(keys[2], (24, 8))
    out, vjp = jax.vjp(swiglu_scaled, gate_and_up, scale)
    want, want_vjp = jax.vjp(lambda h, s: swiglu(h) * s[:, None], gate_and_up, scale)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)
    for a, b in zip(vjp(g), want_vjp(g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    kept = [leaf.shape for leaf in jax.tree.leaves(jax.vjp(swiglu_scaled, gate_and_up, scale)[1])]
    assert (24, 16) in kept and (24, 8) not in kept


def test_biases_and_clamped_swiglu_per_row():
    """gpt-oss's experts: each row (padding rows after the groups included in the call) gets
    (clip(up + up_bias) + 1) * g * sigmoid(alpha g) @ w_down + down_bias of its own expert, with
    g = min(gate + gate_bias, limit); two grouped matmuls, the biases added outside them."""
    experts, dim, hidden, limit, alpha = 4, 8, 6, 0.7, 1.702
    ex = GroupedExperts(
        experts,
        dim,
        hidden,
        gmm=RecordingMatmul(ChunkedGroupedMatmul(chunk=4)),
        bias=True,
        swiglu_limit=limit,
        swiglu_alpha=alpha,
        key=jax.random.key(0),
    )
    keys = jax.random.split(jax.random.key(2), 3)
    biases = (ex.gate_bias, ex.up_bias, ex.down_bias)
    random = tuple(jax.random.normal(k, b.shape) for k, b in zip(keys, biases, strict=True))
    ex = eqx.tree_at(lambda e: (e.gate_bias, e.up_bias, e.down_bias), ex, random)
    sizes = np.array([3, 0, 5, 2])
    rows = 3 * jax.random.normal(jax.random.key(1), (int(sizes.sum()) + 2, dim))  # 2 padding
    recorded.clear()
    out = eqx.filter_jit(lambda e, r, s: e(r, s))(ex, rows, jnp.asarray(sizes))
    assert recorded == [(experts, dim, 2 * hidden), (experts, hidden, dim)]
    owner = np.repeat(np.arange(experts), sizes)
    clamped = 0
    for r, e in enumerate(owner):
        gate = rows[r] @ ex.w_gate[e] + ex.gate_bias[e]
        up = rows[r] @ ex.w_up[e] + ex.up_bias[e]
        clamped += int(jnp.sum(gate > limit) + jnp.sum(jnp.abs(up) > limit))
        g = jnp.minimum(gate, limit)
        h = (jnp.clip(up, -limit, limit) + 1) * g * jax.nn.sigmoid(alpha * g)
        np.testing.assert_allclose(out[r], h @ ex.w_down[e] + ex.down_bias[e], **FP32)
    assert clamped > 10  # the clamp binds on both sides of the test
    assert bool(jnp.isfinite(out).all())


def test_biased_experts_refuse_row_weights():
    ex = GroupedExperts(4, 8, 6, gmm=ChunkedGroupedMatmul(), bias=True, key=jax.random.key(0))
    rows, sizes = jnp.ones((4, 8)), jnp.array([1, 1, 1, 1])
    with pytest.raises(ValueError, match="weights_before_down=False"):
        ex(rows, sizes, jnp.ones(4))
    with pytest.raises(ValueError, match="swiglu_limit"):
        GroupedExperts(4, 8, 6, gmm=ChunkedGroupedMatmul(), swiglu_limit=0.0, key=jax.random.key(0))
