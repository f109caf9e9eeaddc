"""Grouped experts: one SwiGLU per expert, applied to expert-contiguous rows.

The arithmetic on ragged groups is a strategy (`AbstractGroupedMatmul`), so a backend can swap in
Transformer Engine's grouped GEMM or a Pallas kernel while the weights stay where they are.
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from dropless._swiglu import clamped_swiglu, gate_up, init_linear, swiglu, swiglu_grad_in_blocks


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


def expert_of_row(group_sizes: Int[Array, " experts"], rows: int) -> Int[Array, " rows"]:
    """The expert owning each row; rows past sum(group_sizes) get `experts` (none)."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


class GroupedExperts(eqx.Module):
    """SwiGLU experts with weights in one canonical layout, whatever the strategy.

    gpt-oss's options: `bias` (each expert's gate, up and down projections add a bias:
    `gate_bias`, `up_bias`, `down_bias`) and `swiglu_limit` (the clamped SwiGLU,
    `clamped_swiglu`, with `swiglu_alpha`). Either takes the unfused path whatever the
    strategy: one grouped matmul for gate and up, the biases added outside it (each row reads
    its expert's), the activation, the down projection. Without them the path is the plain SwiGLU's.
    """

    w_gate: Float[Array, "experts dim hidden"]
    w_up: Float[Array, "experts dim hidden"]
    w_down: Float[Array, "experts hidden dim"]
    gate_bias: Float[Array, "experts hidden"] | None
    up_bias: Float[Array, "experts hidden"] | None
    down_bias: Float[Array, "experts dim"] | None
    gmm: AbstractGroupedMatmul
    swiglu_limit: float | None = eqx.field(default=None, static=True)
    swiglu_alpha: float = eqx.field(default=1.702, static=True)

    def __init__(
        self,
        n_experts: int,
        dim: int,
        hidden: int,
        *,
        gmm: AbstractGroupedMatmul,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        if swiglu_limit is not None and not swiglu_limit > 0:
            raise ValueError(f"swiglu_limit ({swiglu_limit}) must be > 0, or None")
        k_gate, k_up, k_down = jax.random.split(key, 3)
        self.w_gate = init_linear(k_gate, (n_experts, dim, hidden), dim, dtype)
        self.w_up = init_linear(k_up, (n_experts, dim, hidden), dim, dtype)
        self.w_down = init_linear(k_down, (n_experts, hidden, dim), hidden, dtype)
        zeros = (lambda *s: jnp.zeros(s, dtype)) if bias else (lambda *s: None)
        self.gate_bias, self.up_bias = zeros(n_experts, hidden), zeros(n_experts, hidden)
        self.down_bias = zeros(n_experts, dim)
        self.gmm = gmm
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha

    @property
    def plain(self) -> bool:
        """No biases and the plain SwiGLU: the path every strategy computes its own way."""
        return self.down_bias is None and self.swiglu_limit is None

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
            if not self.plain:
                if row_weights is not None:
                    raise ValueError(
                        "expert biases and the clamped SwiGLU need the routing weights applied "
                        "to the experts' outputs (weights_before_down=False)"
                    )
                return self._biased(rows, group_sizes)
            weights = (self.w_gate, self.w_up, group_sizes, row_weights)
            if isinstance(self.gmm, AbstractFusedSwiGLUMatmul):
                hidden = self.gmm.gate_up_swiglu(rows, *weights)
            else:
                hidden = gate_up_swiglu(self.gmm, rows, *weights)
            return self.gmm(hidden, self.w_down.astype(rows.dtype), group_sizes)

    def _biased(
        self, rows: Float[Array, "rows dim"], group_sizes: Int[Array, " experts"]
    ) -> Float[Array, "rows dim"]:
        dt = rows.dtype
        gate_and_up = self.gmm(rows, gate_up(self.w_gate, self.w_up, dt), group_sizes)
        owner = None
        if self.down_bias is not None:  # rows past the groups read the last expert's: ignored
            owner = jnp.minimum(expert_of_row(group_sizes, rows.shape[0]), group_sizes.shape[0] - 1)
            gate_and_up = gate_and_up + jnp.concatenate([self.gate_bias, self.up_bias], -1)[
                owner
            ].astype(dt)
        if self.swiglu_limit is None:
            hidden = swiglu(gate_and_up)
        else:
            hidden = clamped_swiglu(gate_and_up, self.swiglu_alpha, self.swiglu_limit)
        out = self.gmm(hidden, self.w_down.astype(dt), group_sizes)
        return out if owner is None else out + self.down_bias[owner].astype(dt)
