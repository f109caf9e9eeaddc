"""MXFP4 tensors, as gpt-oss releases its experts: `dequantize_mxfp4`, and which checkpoint
tensors are stored that way (`packed_tensors`).

A checkpoint whose `quantization_config.quant_method` is "mxfp4" stores a tensor `<name>` of
Hugging Face shape [*lead, cols, rows] as `<name>_blocks` [*lead, rows, cols / 32, 16] and
`<name>_scales` [*lead, rows, cols / 32] (uint8 both; gpt-oss's `mlp.experts.gate_up_proj` and
`down_proj`); everything else is stored plainly (bfloat16).
"""

from collections.abc import Mapping

import numpy as np
from jaxtyping import Float, UInt8

from dropless.models.deepseek_v3.hf._files import Checkpoint

BLOCK = 32  # values per scale
# FP4 E2M1 by its 4-bit code: sign bit, then two exponent bits and one mantissa bit
FP4_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_ROWS = 1 << 16  # rows per chunk: small temporaries


def dequantize_mxfp4(
    blocks: UInt8[np.ndarray, "*lead rows groups 16"],
    scales: UInt8[np.ndarray, "*lead rows groups"],
    dtype: np.dtype | type = np.float32,
) -> Float[np.ndarray, "*lead rows cols"]:
    """The values of MXFP4 `blocks` and `scales` (OCP microscaling FP4), in `dtype`.

    Each row holds `groups` blocks of 32 values (`cols = 32 * groups`). A value is 4 bits of FP4
    E2M1 (a sign, two exponent bits and one mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}),
    two to a byte of `blocks`, the first in the low nibble; a block's scale is one E8M0 byte
    `s` of `scales`, the factor 2^(s - 127). Exact in float32 and bfloat16 (a power of two
    times at most two significant bits) within their range; past it (6 * 2^127, or `s` = 255,
    NaN in the OCP format) inf, as in transformers. Rows are dequantised a chunk at a time.
    """
    *lead, rows, groups, width = blocks.shape
    if width != BLOCK // 2 or tuple(scales.shape) != (*lead, rows, groups):
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)}: expected "
            f"[*lead, rows, groups, {BLOCK // 2}] and [*lead, rows, groups]"
        )
    out = np.empty((*lead, rows, groups * BLOCK), dtype)
    flat_blocks, flat_scales = blocks.reshape(-1, groups, width), scales.reshape(-1, groups, 1)
    flat_out = out.reshape(-1, groups, BLOCK)
    for r in range(0, len(flat_out), _ROWS):
        b = flat_blocks[r : r + _ROWS]
        values = np.empty((*b.shape[:-1], BLOCK), np.float32)
        values[..., 0::2] = FP4_E2M1[b & 0x0F]
        values[..., 1::2] = FP4_E2M1[b >> 4]
        exponent = flat_scales[r : r + _ROWS].astype(np.int32) - 127
        flat_out[r : r + _ROWS] = np.ldexp(values, exponent)
    return out


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The `_blocks` shape that stores a tensor of Hugging Face shape `shape` (None: its
    second-last axis is no multiple of 32)."""
    *lead, cols, rows = shape
    return None if cols % BLOCK else (*lead, rows, cols // BLOCK, BLOCK // 2)


def packed_tensors(
    shapes: Mapping[str, tuple[int, ...]], ckpt: Checkpoint
) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """{name: (its `_blocks`, its `_scales`)} for the tensors of `shapes` that `ckpt` stores as
    MXFP4 (its `_blocks` there, itself not), and the problems with them (wrong or missing
    companions), each a line naming the tensor."""
    pairs, problems = {}, []
    for name, shape in shapes.items():
        blocks, scales = f"{name}_blocks", f"{name}_scales"
        if name in ckpt.where or blocks not in ckpt.where:
            continue
        pairs[name] = (blocks, scales)
        want = packed_shape(shape)
        b = ckpt.info(blocks)
        if want is None or b.dtype != "U8" or b.shape != want:
            problems.append(
                f"{blocks} is {b.dtype} {list(b.shape)}; MXFP4 of {name} {list(shape)} needs "
                + (f"U8 {list(want)}" if want else f"its axis -2 a multiple of {BLOCK}")
            )
        elif scales not in ckpt.where:
            problems.append(f"{blocks} without {scales}")
        elif (s := ckpt.info(scales)).dtype != "U8" or s.shape != want[:-1]:
            problems.append(f"{scales} is {s.dtype} {list(s.shape)}, needs U8 {list(want[:-1])}")
    return pairs, problems
