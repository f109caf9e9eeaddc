"""SwiGLU: the dense feed-forward network (dense layers, shared experts), and the functions the
routed experts and their kernels share with it (`gate_up`, `swiglu` and its gradients)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


def init_linear(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int, dtype) -> Array:
    """A normal of scale 1/sqrt(fan_in) truncated at two scales (so a standard deviation of
    about 0.88/sqrt(fan_in)), the init every projection here uses."""
    std = fan_in**-0.5
    return (std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)).astype(dtype)


class SwiGLU(eqx.Module):
    """y = (silu(x @ w_gate) * (x @ w_up)) @ w_down, computed in the input's dtype."""

    w_gate: Float[Array, "dim hidden"]
    w_up: Float[Array, "dim hidden"]
    w_down: Float[Array, "hidden dim"]

    def __init__(self, dim: int, hidden: int, *, dtype=jnp.float32, key: PRNGKeyArray):
        k_gate, k_up, k_down = jax.random.split(key, 3)
        self.w_gate = init_linear(k_gate, (dim, hidden), dim, dtype)
        self.w_up = init_linear(k_up, (dim, hidden), dim, dtype)
        self.w_down = init_linear(k_down, (hidden, dim), hidden, dtype)

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        dt = x.dtype
        return swiglu(x @ gate_up(self.w_gate, self.w_up, dt)) @ self.w_down.astype(dt)


def gate_up(
    w_gate: Float[Array, "*experts dim hidden"], w_up: Float[Array, "*experts dim hidden"], dtype
) -> Float[Array, "*experts dim 2*hidden"]:
    """Gate and up weights side by side, in `dtype`: one matmul computes both projections, and
    its input gradient is one matmul too (two, plus their sum, when they are separate). Where
    the weights are cast to a narrower compute dtype here, the copy is that cast; where they
    are not (float32 compute, or a stack cast before the layer scan) it is one more copy of
    the weights a step, small beside the matmuls it merges."""
    return jnp.concatenate([w_gate, w_up], axis=-1).astype(dtype)


def swiglu(gate_and_up: Float[Array, "*batch gate_up"]) -> Float[Array, "*batch hidden"]:
    """silu(gate) * up from the output of a `gate_up` matmul."""
    gate, up = jnp.split(gate_and_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def clamped_swiglu(
    gate_and_up: Float[Array, "*batch gate_up"], alpha: float, limit: float
) -> Float[Array, "*batch hidden"]:
    """gpt-oss's SwiGLU from the output of a `gate_up` matmul: the gate clamped above at
    `limit`, the up projection to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = jnp.split(gate_and_up, 2, axis=-1)
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


def swiglu_grad(gate: Array, up: Array, d_out: Array) -> tuple[Array, Array]:
    """The gradients of `silu(gate) * up` for the output's gradient `d_out`, elementwise (the
    three broadcast together), in their dtype: for hand-written backwards that lay out or
    scale gate and up their own way."""
    sigmoid = jax.nn.sigmoid(gate)
    return d_out * up * sigmoid * (1.0 + gate * (1.0 - sigmoid)), d_out * gate * sigmoid


def swiglu_grad_in_blocks(
    gate_and_up: Float[Array, "rows gate_up"],
    d_hidden: Float[Array, "rows hidden"],
    block: int,
    row_scale: Float[Array, " rows"] | None = None,
) -> tuple[Float[Array, "rows gate_up"], Float[Array, " rows"] | None]:
    """The gradients of `silu(gate) * up` (times `row_scale[r]` per row, if given) in float32,
    with gate and up side by side in blocks of `block` columns (gate block 0, up block 0, gate
    block 1, ...; `block = hidden` is `gate_up`'s layout, all gate then all up), in that
    layout, and `row_scale`'s gradient (None without one).

    One elementwise expression over the [rows, blocks, 2, block] view: each element computes
    its pair's sigmoid and picks its own formula, so XLA makes one pass of it where splitting,
    differentiating and joining again take three, and 2.4x the time. The scale's gradient,
    `sum(silu(gate) * up * d_hidden)` per row, is a sum over the same view (the gate's elements
    carry it, the up's add zero), so that XLA can take it in that pass too."""
    rows, width = gate_and_up.shape
    blocks = width // 2 // block
    pairs = gate_and_up.reshape(rows, blocks, 2, block).astype(jnp.float32)
    gate, up = pairs[:, :, :1], pairs[:, :, 1:]
    d_out = d_hidden.reshape(rows, blocks, 1, block).astype(jnp.float32)
    is_gate = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 2, 1), 2) == 0
    d_scale = None
    if row_scale is not None:
        d_scale = jnp.sum(jnp.where(is_gate, jax.nn.silu(gate) * up * d_out, 0.0), axis=(1, 2, 3))
        d_out = d_out * row_scale.astype(jnp.float32)[:, None, None, None]
    d_gate, d_up = swiglu_grad(gate, up, d_out)
    return jnp.where(is_gate, d_gate, d_up).reshape(rows, width), d_scale
