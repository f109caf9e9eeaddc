"""Neural-network building blocks: norms, rotary embeddings, attention (MLA and grouped-query),
and unrolled loops over stacked layers. (The SwiGLU feed-forward network is
`dropless.swiglu.SwiGLU`; the decoder block, which holds an MoE layer, is the model's:
`dropless.models.deepseek_v3.block`.)"""

from dropless.nn.attention import GQA, attend
from dropless.nn.blockwise_attention import blockwise_attention
from dropless.nn.mla import (
    ATTENTIONS,
    MLA,
    AbstractAttention,
    BlockwiseAttention,
    CudnnAttention,
    XlaAttention,
)
from dropless.nn.rmsnorm import RMSNorm
from dropless.nn.rope import RotaryEmbedding, rope_frequencies, softmax_scale, yarn_get_mscale
from dropless.nn.unroll import split_layers, unrolled_scan

__all__ = [
    "ATTENTIONS",
    "GQA",
    "MLA",
    "AbstractAttention",
    "BlockwiseAttention",
    "CudnnAttention",
    "XlaAttention",
    "blockwise_attention",
    "RMSNorm",
    "RotaryEmbedding",
    "attend",
    "rope_frequencies",
    "softmax_scale",
    "split_layers",
    "unrolled_scan",
    "yarn_get_mscale",
]
