"""The Pallas backend's tile table (CPU-checkable parts; the kernels are tested under `gpu`)."""

import re

import pytest

from dropless.backends import pallas


def test_untuned_shape_gets_the_default_tiles():
    assert pallas.block_config("fwd", 7 * 128, 3 * 128) == pallas.BlockConfig()


@pytest.mark.parametrize(
    ("op", "in_width", "out_width", "named"),
    [
        ("fwd", 100, 128, "block_k=64"),  # contracts the input width
        ("fwd", 128, 100, "block_n*grid_block_n=128"),
        ("dgrad", 128, 100, "block_k=64"),  # contracts the output width
        ("dgrad", 100, 128, "block_n*grid_block_n=128"),
        ("wgrad", 100, 128, "block_m=128"),
        ("wgrad", 128, 100, "block_n=128"),
    ],
)
def test_widths_that_tiles_do_not_divide_are_named(op, in_width, out_width, named):
    with pytest.raises(
        ValueError, match=rf"\({op}, widths {in_width} -> {out_width}\).*{re.escape(named)}"
    ):
        pallas.block_config(op, in_width, out_width)


def test_tuned_entries_divide_their_shapes():
    for (op, in_width, out_width), cfg in pallas.TUNED.items():
        pallas.check_divides(op, cfg, in_width, out_width)
