"""Grouped experts: one SwiGLU per expert, applied to expert-contiguous rows.

The arithmetic on ragged groups is a strategy (`AbstractGroupedMatmul`), so a backend can swap in
Transformer Engine's grouped GEMM or a Pallas kernel while the weights stay where they are.
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from dropless.swiglu import gate_up, init_linear, swiglu, swiglu_grad_in_blocks


class AbstractGroupedMatmul(eqx.Module):
    """out[r] = lhs[r] @ rhs[e] for every row r in group e; rows past sum(group_sizes) are
    padding and come out as zeros (or anything finite: callers ignore them)."""

    requires_gpu: eqx.AbstractClassVar[bool]
    """Whether the strategy runs only on a GPU (`available_backends()` and the tests skip it
    elsewhere); every concrete strategy says."""

    def __call__(
        self,
        lhs: Float[Array, "rows in_"],
        rhs: Float[Array, "experts in_ out"],
        group_sizes: Int[Array, " experts"],
    ) -> Float[Array, "rows out"]:
        if lhs.shape[1] != rhs.shape[1]:
            raise ValueError(f"lhs width {lhs.shape[1]} != rhs input width {rhs.shape[1]}")
        if group_sizes.shape[0] != rhs.shape[0]:
            raise ValueError(
                f"group_sizes has {group_sizes.shape[0]} groups, rhs has {rhs.shape[0]} experts"
            )
        return self._impl(lhs, rhs, group_sizes)

    @abc.abstractmethod
    def _impl(
        self,
        lhs: Float[Array, "rows in_"],
        rhs: Float[Array, "experts in_ out"],
        group_sizes: Int[Array, " experts"],
    ) -> Float[Array, "rows out"]: ...


class AbstractFusedSwiGLUMatmul(AbstractGroupedMatmul):
    """A grouped matmul that also computes the experts' gate-and-up SwiGLU its own way (for
    example in one kernel): `GroupedExperts` calls its `gate_up_swiglu` instead of the
    module-level `gate_up_swiglu`, which it must equal."""

    @abc.abstractmethod
    def gate_up_swiglu(
        self,
        rows: Float[Array, "rows dim"],
        w_gate: Float[Array, "experts dim hidden"],
        w_up: Float[Array, "experts dim hidden"],
        group_sizes: Int[Array, " experts"],
        row_scale: Float[Array, " rows"] | None = None,
    ) -> Float[Array, "rows hidden"]: ...


def gate_up_swiglu(
    gmm: AbstractGroupedMatmul,
    rows: Float[Array, "rows dim"],
    w_gate: Float[Array, "experts dim hidden"],
    w_up: Float[Array, "experts dim hidden"],
    group_sizes: Int[Array, " experts"],
    row_scale: Float[Array, " rows"] | None = None,
) -> Float[Array, "rows hidden"]:
    """silu(rows @ w_gate[e]) * (rows @ w_up[e]) per group (times `row_scale[r]` per row, if
    given), the weights cast to the rows' dtype: one grouped matmul by `gmm` over the weights
    side by side, then the SwiGLU (`swiglu_scaled` with a scale)."""
    gate_and_up = gmm(rows, gate_up(w_gate, w_up, rows.dtype), group_sizes)
    return swiglu(gate_and_up) if row_scale is None else swiglu_scaled(gate_and_up, row_scale)


@jax.custom_vjp
def swiglu_scaled(
    gate_and_up: Float[Array, "rows gate_up"], scale: Float[Array, " rows"]
) -> Float[Array, "rows hidden"]:
    """`swiglu(gate_and_up) * scale[:, None]`, in float32, rounded to the input's dtype. The
    backward keeps only the inputs: it recomputes the SwiGLU for the scale's gradient, over the
    same view as the input's (`swiglu_grad_in_blocks`), so no `[rows hidden]` array is kept."""
    gate, up = (h.astype(jnp.float32) for h in jnp.split(gate_and_up, 2, axis=-1))
    return (jax.nn.silu(gate) * up * scale[:, None].astype(jnp.float32)).astype(gate_and_up.dtype)


def _swiglu_scaled_fwd(gate_and_up, scale):
    return swiglu_scaled(gate_and_up, scale), (gate_and_up, scale)


def _swiglu_scaled_bwd(res, d_out):
    gate_and_up, scale = res
    hidden = gate_and_up.shape[-1] // 2  # one block: all gate, then all up
    d_gate_and_up, d_scale = swiglu_grad_in_blocks(gate_and_up, d_out, hidden, scale)
    return d_gate_and_up.astype(gate_and_up.dtype), d_scale.astype(scale.dtype)


swiglu_scaled.defvjp(_swiglu_scaled_fwd, _swiglu_scaled_bwd)


class GroupedExperts(eqx.Module):
    """SwiGLU experts with weights in one canonical layout, whatever the strategy."""

    w_gate: Float[Array, "experts dim hidden"]
    w_up: Float[Array, "experts dim hidden"]
    w_down: Float[Array, "experts hidden dim"]
    gmm: AbstractGroupedMatmul

    def __init__(
        self,
        n_experts: int,
        dim: int,
        hidden: int,
        *,
        gmm: AbstractGroupedMatmul,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        k_gate, k_up, k_down = jax.random.split(key, 3)
        self.w_gate = init_linear(k_gate, (n_experts, dim, hidden), dim, dtype)
        self.w_up = init_linear(k_up, (n_experts, dim, hidden), dim, dtype)
        self.w_down = init_linear(k_down, (n_experts, hidden, dim), hidden, dtype)
        self.gmm = gmm

    def __call__(
        self,
        rows: Float[Array, "rows dim"],
        group_sizes: Int[Array, " experts"],
        row_weights: Float[Array, " rows"] | None = None,
    ) -> Float[Array, "rows dim"]:
        """Each row through its group's expert. `row_weights`: a factor per row applied to the
        hidden units before the down projection (the same as scaling the output: it is linear
        in them), in float32, then rounded to the rows' dtype."""
        with jax.named_scope("experts"):
            weights = (self.w_gate, self.w_up, group_sizes, row_weights)
            if isinstance(self.gmm, AbstractFusedSwiGLUMatmul):
                hidden = self.gmm.gate_up_swiglu(rows, *weights)
            else:
                hidden = gate_up_swiglu(self.gmm, rows, *weights)
            return self.gmm(hidden, self.w_down.astype(rows.dtype), group_sizes)
