"""The weight-gradient kernel's settings (`WeightGradConfig`, chosen per shape by
`weight_grad_config_for`), whether its tiles divide a weight, and the runs of consecutive
experts that one segmented pipeline walks (`expert_segments`). No kernel code: the kernel is
`weight_grad.grouped_weight_grad`."""

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Int

from dropless.backends.mosaic._launch import group_bounds


@dataclasses.dataclass(frozen=True)
class WeightGradConfig:
    """Tiles of the weight gradient: a thread block computes `2*tile_m x tile_n` of a `[k n]`
    gradient (one `tile_m` half per compute warpgroup), walking rows `tile_k` at a time. `band`
    as in `KernelConfig`: 16 was the fastest of 4 / 8 / 16 on an H200 at DeepSeek-V3 widths,
    most with 256 small experts.

    `segment_steps`: a thread block walks the rows of a run of consecutive experts (about this
    many `tile_k` chunks, in a power-of-two number of runs) in one pipeline, storing each
    expert's tile when its rows end; so a small expert costs no pipeline fill and drain of its
    own. None: one pipeline per expert and tile."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 3
    band: int = 16
    segment_steps: int | None = None

    def __post_init__(self):
        if self.segment_steps is not None and self.segment_steps < 1:
            raise ValueError(
                f"WeightGradConfig.segment_steps={self.segment_steps} must be None or >= 1"
            )


def weight_grad_config_for(rows: int, n_groups: int) -> WeightGradConfig:
    """The weight gradient's settings for `rows` over `n_groups`. Chosen on an H200 by kernel
    time: runs of 64 chunks where experts average at most 512 rows (at 256, +4-7% balanced and
    +18-31% Dirichlet over one pipeline per expert; at 512, -5% and +8%); one pipeline per
    expert above (3-21% faster there, except 1% slower at 2048 Dirichlet)."""
    if rows <= 512 * n_groups:
        return WeightGradConfig(segment_steps=64)
    return WeightGradConfig()


def weight_grad_fits(k: int, n: int, config: WeightGradConfig | None = None) -> bool:
    """Whether the weight-gradient tiles divide a `[k n]` weight."""
    c = config or WeightGradConfig()
    return k % (2 * c.tile_m) == 0 and n % c.tile_n == 0


def expert_segments(
    group_sizes: Int[Array, " experts"], rows: int, segments: int
) -> Int[Array, " segments_plus_1"]:
    """The first group of each of `segments` runs of consecutive groups, and the group count at
    the end: a run starts at the first group that starts at or past its share of the rows, so
    the runs hold about even rows (a group larger than a share leaves some runs empty)."""
    starts, ends = group_bounds(group_sizes, rows)
    share = ends[-1] * jnp.arange(segments + 1) // segments
    first = jnp.searchsorted(starts, share, side="left", method="compare_all")
    return first.at[0].set(0).at[-1].set(group_sizes.shape[0]).astype(jnp.int32)
