"""bench_moe.py with the weight gradient's segmented pipelines where experts are small (mean
rows per expert <= 384): `python bench_segmented.py STEPS [bench_moe arguments]`. A measurement
aid for the ninth run, not library code: it swaps the default WeightGradConfig in this process."""

import sys

import bench_moe

from dropless.backends import mosaic_gmm

steps = int(sys.argv[1])
plain = mosaic_gmm.grouped_weight_grad


def segmented(lhs, grad, group_sizes, *, config=None):
    if config is None and lhs.shape[0] <= 384 * group_sizes.shape[0]:
        config = mosaic_gmm.WeightGradConfig(segment_steps=steps)
    return plain(lhs, grad, group_sizes, config=config)


mosaic_gmm.grouped_weight_grad = segmented
bench_moe.main(sys.argv[2:])
