"""Neural-network building blocks: norms, rotary embeddings, attention (MLA and grouped-query),
and unrolled loops over stacked layers. (The SwiGLU feed-forward network is
`dropless.SwiGLU`; the decoder block, which holds an MoE layer, is the model's:
`dropless.models.deepseek_v3._block`.)"""

from dropless.nn._attention import GQA, attend
from dropless.nn._blockwise_attention import blockwise_attention
from dropless.nn._mla import (
    ATTENTIONS,
    MLA,
    AbstractAttention,
    BlockwiseAttention,
    CudnnAttention,
    XlaAttention,
    cudnn_attention,
)
from dropless.nn._rmsnorm import RMSNorm
from dropless.nn._rope import RotaryEmbedding, rope_frequencies, softmax_scale, yarn_get_mscale
from dropless.nn._unroll import split_layers, unrolled_scan

__all__ = [
    "ATTENTIONS",
    "GQA",
    "MLA",
    "AbstractAttention",
    "BlockwiseAttention",
    "CudnnAttention",
    "XlaAttention",
    "blockwise_attention",
    "cudnn_attention",
    "RMSNorm",
    "RotaryEmbedding",
    "attend",
    "rope_frequencies",
    "softmax_scale",
    "split_layers",
    "unrolled_scan",
    "yarn_get_mscale",
]
