"""Warp-specialised grouped matmuls for Hopper, written in Pallas' Mosaic GPU dialect.

`out[r] = lhs[r] @ rhs[e]` for the expert-contiguous rows r of each group e (and, with
`transpose_rhs`, `lhs[r] @ rhs[e].T`, the input gradient). Two things make it fast where
JAX's `ragged_dot_mgpu` is slow with many experts:

- A tile schedule computed by XLA before the launch: one entry per row tile of each group, in
  row order, the tiles starting at the group's first row. A kernel step reads its entry (four
  scalars) instead of scanning every group boundary, which costs O(experts) per tile.
- The Hopper matmul recipe: a memory warpgroup streams `lhs` and `rhs` tiles into shared memory
  through TMA while two compute warpgroups multiply them (each a `tile_m x tile_n` half of the
  block), so loads and tensor-core work overlap.

A group's last tile usually reaches into the next group's rows. It is computed whole, and stores
only its own rows, through a ladder of power-of-two TMA stores (the row count is known only at
run time). Tiles aligned to the groups (to 8 rows) rather than to fixed row blocks take about
ceil(n / tile_m) passes for a group of n rows: with 256 experts of 256 rows on average
(Dirichlet or multinomial draws), about 640-670 passes where fixed blocks take about 765, a
block shared by two groups costing a pass for each.
Rows after the last group are computed with the last expert's weights: finite for finite input,
as the grouped-matmul contract asks. The weight gradient ignores them, which is exact because
callers ignore those rows (their output gradient is zero).

Modules: `_schedule` (the forward's settings and tile schedule), `_forward` (the forward and
input-gradient kernel, and its fused SwiGLU epilogue), `_gate_up` (the fused kernel's weight
layout), `_weight_grad_schedule` (the weight gradient's settings and runs of experts),
`_weight_grad` (the weight-gradient kernel), `_launch` (the frame they share; tests run the
kernels through Mosaic GPU's interpreter by setting `_launch.INTERPRET`).
"""

from dropless.backends.mosaic._forward import grouped_matmul, grouped_matmul_swiglu
from dropless.backends.mosaic._gate_up import (
    interleave_gate_up,
    split_gate_up,
    swiglu_grad_interleaved,
)
from dropless.backends.mosaic._launch import ROW_ALIGN
from dropless.backends.mosaic._schedule import KernelConfig, config_for, matmul_fits, tile_schedule
from dropless.backends.mosaic._weight_grad import grouped_weight_grad
from dropless.backends.mosaic._weight_grad_schedule import (
    WeightGradConfig,
    expert_segments,
    weight_grad_config_for,
    weight_grad_fits,
)

__all__ = [
    "ROW_ALIGN",
    "KernelConfig",
    "WeightGradConfig",
    "config_for",
    "expert_segments",
    "grouped_matmul",
    "grouped_matmul_swiglu",
    "grouped_weight_grad",
    "interleave_gate_up",
    "matmul_fits",
    "split_gate_up",
    "swiglu_grad_interleaved",
    "tile_schedule",
    "weight_grad_config_for",
    "weight_grad_fits",
]
