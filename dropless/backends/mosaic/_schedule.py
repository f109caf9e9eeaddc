"""The forward kernel's settings and its tile schedule: which rows of which group each work
item of the row loop covers, computed by XLA before the launch."""

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Int

from dropless.backends.mosaic._launch import ROW_ALIGN, group_bounds


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes. A thread block computes `tile_m x 2*tile_n` outputs (one half per compute
    warpgroup), contracting `tile_k` at a time with up to `max_concurrent_steps` loads in
    flight; `band` column blocks are walked together so that concurrent blocks share weights."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 3
    band: int = 4
    # Chain the row blocks' pipelines: the memory warpgroup loads the next block while the
    # compute warpgroups finish and store this one, so no bubble between blocks. JAX allows it
    # only when `max_concurrent_steps` divides the steps (`k / tile_k`).
    chain: bool = False

    def __post_init__(self):
        if self.tile_m & (self.tile_m - 1):
            raise ValueError(f"KernelConfig.tile_m={self.tile_m} must be a power of two")


def config_for(out_width: int) -> KernelConfig:
    """Tiles for an output `out_width` wide. Chosen on an H200: 2 x 128 columns per block with
    3 loads in flight is fastest at DeepSeek-V3 widths; shared memory (227 KiB) allows no 4th.
    Widths that 256 does not divide get 2 x 64 columns."""
    if out_width % 256:
        return KernelConfig(tile_n=64, max_concurrent_steps=4, band=8)
    return KernelConfig()


def tile_schedule(
    group_sizes: Int[Array, " experts"], rows: int, tile_m: int
) -> tuple[Int[Array, "4 slots"], Int[Array, "1"]]:
    """Work items of the row loop, in row order: (group, the tile's first row / `ROW_ALIGN`,
    first, end), the last two as offsets within the tile; and how many items are real. Each
    group's tiles start at its first row, rounded down to a multiple of `ROW_ALIGN`, so a group
    of n rows takes about ceil(n / tile_m) items. A tile that would run past `rows` is moved
    back to end there. The last group is stretched to cover every row to `rows`. `slots` = row
    blocks + groups - 1 bounds the item count."""
    n_groups = group_sizes.shape[0]
    n_blocks = -(-rows // tile_m)
    slots = n_blocks + n_groups - 1
    starts, ends = group_bounds(group_sizes, rows)
    ends = ends.at[-1].set(rows)
    aligned = starts // ROW_ALIGN * ROW_ALIGN
    tiles = jnp.where(ends > starts, -(-(ends - aligned) // tile_m), 0)
    items_before = jnp.cumsum(tiles)
    item = jnp.arange(slots, dtype=jnp.int32)
    # compare_all: one elementwise kernel, where the default method is a loop of log2(groups)
    # trips, each a few small kernels on a GPU
    owner = jnp.searchsorted(items_before, item, side="right", method="compare_all")
    group = jnp.minimum(owner, n_groups - 1)
    tile_row = aligned[group] + (item - (items_before[group] - tiles[group])) * tile_m
    row0 = jnp.minimum(tile_row, rows - tile_m)  # rows >= tile_m: every load in bounds
    first = jnp.maximum(tile_row, starts[group]) - row0
    end = jnp.clip(ends[group] - row0, first, tile_m)
    schedule = jnp.stack([group, row0 // ROW_ALIGN, first, end]).astype(jnp.int32)
    return schedule, items_before[-1:].astype(jnp.int32)


def matmul_fits(k: int, n: int, config: KernelConfig | None = None) -> bool:
    """Whether `grouped_matmul` with these settings runs a contraction over `k` into `n`
    columns: the tiles divide both widths and, chained, the stages divide the steps."""
    c = config or config_for(n)
    return k % c.tile_k == 0 and n % (2 * c.tile_n) == 0 and chain_fits(k // c.tile_k, c)


def chain_fits(steps: int, c: KernelConfig) -> bool:
    return not c.chain or steps % c.max_concurrent_steps == 0
