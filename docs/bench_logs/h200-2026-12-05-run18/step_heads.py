"""The batch-24 proxy-2b step with its attention heads as they are (16 heads, query-key width
96 = 64 + 32 rope, value width 64) and as 8 heads of DeepSeek-V3's own widths (192 = 128 + 64
rope, 128): the same projections' sizes (8 x 192 = 16 x 96, 8 x 128 = 16 x 64) and the same
attention FLOPs, in one process. Run from experiments/ with it on PYTHONPATH."""

import dataclasses
import sys

from bench_train import compare

from dropless.models.deepseek_v3 import get_preset

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 24
proxy = get_preset("proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn")
v3_heads = dataclasses.replace(
    proxy, num_attention_heads=8, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
)
for name, config in {
    "16 heads 96/64 (proxy-2b)": proxy,
    "8 heads 192/128 (V3 widths)": v3_heads,
}.items():
    compare(config, "pallas", {name: {}}, batch=batch)
