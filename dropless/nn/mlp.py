"""Dense SwiGLU feed-forward network: dense layers and shared experts."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


def init_linear(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int, dtype) -> Array:
    """Truncated-normal init with std 1/sqrt(fan_in), the scale every projection here uses."""
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
        h = jax.nn.silu(x @ self.w_gate.astype(dt)) * (x @ self.w_up.astype(dt))
        return h @ self.w_down.astype(dt)
