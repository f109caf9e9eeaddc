"""Named model sizes, from a CPU-test toy to the exact DeepSeek-V3 671B and Kimi K2 shapes.

| name               | total  | active | MTP    | use                                          |
|--------------------|--------|--------|--------|----------------------------------------------|
| `tiny`             | 0.80M  | 0.28M  | 0.23M  | CPU tests; trains a few hundred steps on CPU |
| `small`            | 105M   | 50M    | 14M    | a quick single-GPU run                       |
| `proxy-2b`         | 1.97B  | 0.33B  | 0.11B  | single-GPU proxy of DeepSeek-V3's routing    |
| `deepseek-v2-lite` | 15.7B  | 2.66B  | -      | DeepSeek-V2-Lite (no q LoRA, greedy softmax) |
| `deepseek-v3-671b` | 671.0B | 37.6B  | 11.6B  | DeepSeek-V3 exactly                          |
| `kimi-k2`          | 1.03T  | 32.9B  | -      | Kimi K2 exactly (384 experts, 64 heads)      |

Active counts include the embedding and head. `count_params` gives the exact numbers;
`tests/models/test_presets.py` checks them.
"""

from collections.abc import Callable
from typing import Any

from dropless.models.deepseek_v3._config import DeepSeekV3Config

_V3_YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def tiny() -> DeepSeekV3Config:
    """About 1M parameters: V3's structure (MLA with q LoRA, grouped sigmoid routing with expert
    bias, a shared expert, one MTP module) at toy width, for tests and laptop training."""
    return DeepSeekV3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=16,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=512,
        num_nextn_predict_layers=1,
    )


def small() -> DeepSeekV3Config:
    """About 100M parameters."""
    return DeepSeekV3Config(
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=256,
        num_hidden_layers=6,
        first_k_dense_replace=1,
        num_attention_heads=8,
        q_lora_rank=192,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.0,
        max_position_embeddings=4096,
        num_nextn_predict_layers=1,
    )


def proxy_2b() -> DeepSeekV3Config:
    """About 2B parameters, fits one GPU for training: V3's routing (64 experts in 8 groups,
    top-6 of 4 groups, sigmoid with bias) at 1/7 width, and V3's own attention heads (query-key
    128 + 64 rope, value 128), 8 of them. Until 2026-12-05 it had 16 heads of half those
    widths: the same projection sizes and attention FLOPs, but cuDNN's attention at 96/64 ran
    at 0.77 of its rate at 192/128, which V3 itself runs at (on an H200);
    `num_attention_heads=16, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64`
    gives the old shape."""
    return DeepSeekV3Config(
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=19,
        first_k_dense_replace=1,
        num_attention_heads=8,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        max_position_embeddings=4096,
        num_nextn_predict_layers=1,
    )


def deepseek_v2_lite() -> DeepSeekV3Config:
    """DeepSeek-V2-Lite (15.7B): no q LoRA, softmax greedy top-6 of 64, two shared experts."""
    return DeepSeekV3Config(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        first_k_dense_replace=1,
        num_attention_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=163840,
        rope_scaling={**_V3_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        num_nextn_predict_layers=0,
    )


def deepseek_v3_671b() -> DeepSeekV3Config:
    """DeepSeek-V3 671B, as in the DeepSeek-V3 repository's config_671B.json / HF config.json."""
    return DeepSeekV3Config(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        first_k_dense_replace=3,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=dict(_V3_YARN),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_nextn_predict_layers=1,
    )


def kimi_k2() -> DeepSeekV3Config:
    """Kimi K2 (Moonshot AI), as in Kimi-K2-Instruct's config.json: DeepSeek-V3's architecture
    with 384 routed experts (top-8, one group), 64 heads, one dense layer, no MTP; exported
    checkpoints say `model_type` "kimi_k2", as Moonshot's do."""
    return deepseek_v3_671b().replace(
        vocab_size=163840,
        num_attention_heads=64,
        n_routed_experts=384,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        max_position_embeddings=131072,
        rope_theta=50000.0,
        rope_scaling={**_V3_YARN, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0},
        num_nextn_predict_layers=0,
        model_type="kimi_k2",
    )


PRESETS: dict[str, Callable[[], DeepSeekV3Config]] = {
    "tiny": tiny,
    "small": small,
    "proxy-2b": proxy_2b,
    "deepseek-v2-lite": deepseek_v2_lite,
    "deepseek-v3-671b": deepseek_v3_671b,
    "kimi-k2": kimi_k2,
}


def get_preset(name: str, **overrides: Any) -> DeepSeekV3Config:
    """The named preset, with any fields overridden (e.g. `compute_dtype="bfloat16"`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    config = PRESETS[name]()
    return config.replace(**overrides) if overrides else config
