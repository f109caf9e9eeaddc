"""The weights' layout of the fused SwiGLU kernel: gate and up interleaved in blocks, and the
SwiGLU's gradient in that order."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from dropless._swiglu import swiglu_grad_in_blocks
from dropless.backends.mosaic._schedule import KernelConfig, config_for


def interleave_gate_up(
    w_gate: Float[Array, "*lead in_ hidden"],
    w_up: Float[Array, "*lead in_ hidden"],
    config: KernelConfig | None = None,
) -> Float[Array, "*lead in_ gate_up"]:
    """Gate and up side by side in blocks of `tile_n // 2` columns (gate block 0, up block 0,
    gate block 1, ...) along the last axis: the weights' layout that `grouped_matmul_swiglu`
    takes, and the order of its gate-and-up output. `split_gate_up` undoes it."""
    *lead, hidden = w_gate.shape
    block = _interleave_block(hidden, config)
    blocks = [w.reshape(*lead, hidden // block, 1, block) for w in (w_gate, w_up)]
    return jnp.concatenate(blocks, axis=-2).reshape(*lead, 2 * hidden)


def split_gate_up(
    gate_up: Float[Array, "*lead gate_up"], config: KernelConfig | None = None
) -> tuple[Float[Array, "*lead hidden"], Float[Array, "*lead hidden"]]:
    """The gate and up halves of an `interleave_gate_up` layout, each in its own order."""
    *lead, width = gate_up.shape
    block = _interleave_block(width // 2, config)
    pairs = gate_up.reshape(*lead, width // 2 // block, 2, block)
    return pairs[..., 0, :].reshape(*lead, width // 2), pairs[..., 1, :].reshape(*lead, width // 2)


def swiglu_grad_interleaved(
    gate_up: Float[Array, "rows gate_up"],
    d_hidden: Float[Array, "rows hidden"],
    config: KernelConfig | None = None,
    *,
    row_scale: Float[Array, " rows"] | None = None,
) -> tuple[Float[Array, "rows gate_up"], Float[Array, " rows"] | None]:
    """The gradients of `silu(gate) * up` (times `row_scale[r]` per row, if given) with
    respect to an `interleave_gate_up`-ordered `gate_up`, in that order, and to `row_scale`
    (None without one), float32, in one pass (`dropless._swiglu.swiglu_grad_in_blocks`)."""
    block = _interleave_block(gate_up.shape[1] // 2, config)
    return swiglu_grad_in_blocks(gate_up, d_hidden, block, row_scale)


def _interleave_block(hidden: int, config: KernelConfig | None) -> int:
    """Half a compute warpgroup's tile: the kernel's gate and up blocks (`config`, or the one
    `config_for` picks for the 2 * hidden output columns)."""
    block = (config or config_for(2 * hidden)).tile_n // 2
    if hidden % block:
        raise ValueError(f"interleaved gate and up: hidden={hidden} must be a multiple of {block}")
    return block
