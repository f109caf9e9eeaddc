"""tune_mosaic.py with one more forward / input-gradient candidate, "fixed blocks": the default
tiles on the tile schedule before 4ee74e3 (fixed 128-row blocks, a block shared by two groups
computed once per group), against the default on group-aligned tiles, in the same rounds:
`python bench_schedule.py [tune_mosaic arguments]`. A measurement aid for the tenth run, not
library code: it swaps `mosaic_gmm.tile_schedule` while the candidate is traced."""

import sys

import jax.numpy as jnp
import tune_mosaic

from dropless.backends import mosaic_gmm

group_aligned = mosaic_gmm.tile_schedule


def fixed_block_schedule(group_sizes, rows, tile_m):
    """The schedule of 42223ea, with the block given in the kernel's ROW_ALIGN units."""
    n_groups = group_sizes.shape[0]
    slots = -(-rows // tile_m) + n_groups - 1
    starts, ends = mosaic_gmm._group_bounds(group_sizes, rows)
    ends = ends.at[-1].set(rows)
    first_block = starts // tile_m
    blocks = jnp.where(ends > starts, -(-ends // tile_m) - first_block, 0)
    items_before = jnp.cumsum(blocks)
    item = jnp.arange(slots, dtype=jnp.int32)
    owner = jnp.searchsorted(items_before, item, side="right", method="compare_all")
    group = jnp.minimum(owner, n_groups - 1)
    block = first_block[group] + item - (items_before[group] - blocks[group])
    row0 = block * tile_m
    first = jnp.clip(starts[group] - row0, 0, tile_m)
    end = jnp.clip(ends[group] - row0, 0, tile_m)
    schedule = jnp.stack([group, row0 // mosaic_gmm.ROW_ALIGN, first, end]).astype(jnp.int32)
    return schedule, items_before[-1:].astype(jnp.int32)


FIXED = mosaic_gmm.KernelConfig()
tune_mosaic.ROW_CANDIDATES["fixed blocks 128x2x128 s3 b4"] = FIXED
plain_kernel = tune_mosaic.kernel


def kernel(op, config):
    f = plain_kernel(op, config)
    if config is not FIXED:
        return f

    def on_fixed_blocks(*args):
        mosaic_gmm.tile_schedule = fixed_block_schedule
        try:
            return f(*args)
        finally:
            mosaic_gmm.tile_schedule = group_aligned

    return on_fixed_blocks


tune_mosaic.kernel = kernel
tune_mosaic.main(sys.argv[1:])
