"""Neural-network building blocks: norms, rotary embeddings, attention, feed-forward, and
unrolled loops over stacked layers.

`DecoderBlock` lives in `dropless.nn.block` and is not re-exported here: it depends on
`dropless.moe`, which itself imports `dropless.nn.mlp`, so importing it here would be circular.
"""

from dropless.nn.mla import MLA
from dropless.nn.mlp import SwiGLU
from dropless.nn.rmsnorm import RMSNorm
from dropless.nn.rope import RotaryEmbedding, rope_frequencies, softmax_scale, yarn_get_mscale
from dropless.nn.unroll import split_layers, unrolled_scan

__all__ = [
    "MLA",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "rope_frequencies",
    "softmax_scale",
    "split_layers",
    "unrolled_scan",
    "yarn_get_mscale",
]
