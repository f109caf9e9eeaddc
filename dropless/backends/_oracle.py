"""Dense one-hot references: slow (O(tokens * experts)), obviously right, used only by tests.

Each optimised path has its "equivalent to" here, and tests hold the two together, forward and
gradient.
"""

from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dropless._experts import AbstractGroupedMatmul


def expert_of_row(group_sizes: Int[Array, " experts"], rows: int) -> Int[Array, " rows"]:
    """The expert owning each row; rows past sum(group_sizes) get `experts` (none)."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


class OneHotGroupedMatmul(AbstractGroupedMatmul):
    """Every row times every expert's matrix, masked to its own expert."""

    requires_gpu: ClassVar[bool] = False

    def _impl(self, lhs, rhs, group_sizes):
        owner = jax.nn.one_hot(
            expert_of_row(group_sizes, lhs.shape[0]), rhs.shape[0], dtype=lhs.dtype
        )
        return jnp.einsum("re,rd,edo->ro", owner, lhs, rhs)


def oracle_moe(moe, x: Float[Array, "tokens dim"]) -> Float[Array, "tokens dim"]:
    """y[t] = sum_k w[t,k] * FFN_{e[t,k]}(x[t]) (+ shared experts), every expert on every token,
    for an `MoE` layer `moe` (its router, experts' weights, biases and activation, and shared
    experts)."""
    routing = moe.router(x)
    n_experts = routing.scores.shape[-1]
    # combine_weights[t, e] = weight of expert e for token t (0 when not chosen)
    one_hot = jax.nn.one_hot(routing.expert_ids, n_experts, dtype=jnp.float32)
    combine_weights = jnp.einsum("tke,tk->te", one_hot, routing.weights)
    ex = moe.experts
    gate = jnp.einsum("td,edh->teh", x, ex.w_gate.astype(x.dtype))
    up = jnp.einsum("td,edh->teh", x, ex.w_up.astype(x.dtype))
    if ex.gate_bias is not None:  # gpt-oss
        gate, up = gate + ex.gate_bias.astype(x.dtype), up + ex.up_bias.astype(x.dtype)
    if ex.swiglu_limit is None:
        hidden = jax.nn.silu(gate) * up
    else:  # gpt-oss's clamped SwiGLU
        gate = jnp.minimum(gate, ex.swiglu_limit)
        up = jnp.clip(up, -ex.swiglu_limit, ex.swiglu_limit)
        hidden = (up + 1) * gate * jax.nn.sigmoid(ex.swiglu_alpha * gate)
    out = jnp.einsum("teh,ehd->ted", hidden, ex.w_down.astype(x.dtype))
    if ex.down_bias is not None:
        out = out + ex.down_bias.astype(x.dtype)
    y = jnp.einsum("ted,te->td", out.astype(jnp.float32), combine_weights).astype(x.dtype)
    if moe.shared is not None:
        y = y + moe.shared(x)
    return y
