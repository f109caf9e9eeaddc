"""Qwen3-MoE sizes: a CPU toy and Qwen3-30B-A3B exactly (its Hugging Face config.json)."""

from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.qwen3_moe._config import QWEN3_MOE


def qwen3_moe_tiny() -> DeepSeekV3Config:
    """About 1M parameters: Qwen3-MoE's structure (GQA with per-head QK norm, softmax top-k of
    16 experts, renormalised) at toy width."""
    return DeepSeekV3Config.from_hf_config(
        {
            "model_type": QWEN3_MOE.model_type,
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 192,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 16,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "max_position_embeddings": 512,
            "rope_theta": 1e6,
        }
    )


def qwen3_30b_a3b() -> DeepSeekV3Config:
    """Qwen3-30B-A3B: 48 layers, 128 experts of which 8 per token, 32 query and 4 key-value
    heads of 128 (30.5B parameters, 3.3B active)."""
    return DeepSeekV3Config.from_hf_config(
        {
            "model_type": QWEN3_MOE.model_type,
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "max_position_embeddings": 40960,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        }
    )
