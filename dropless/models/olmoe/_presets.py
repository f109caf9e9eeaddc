"""OLMoE sizes: a CPU toy and OLMoE-1B-7B exactly (its Hugging Face config.json)."""

from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.olmoe._config import OLMOE


def olmoe_tiny() -> DeepSeekV3Config:
    """About 1M parameters: OLMoE's structure (QK norm over the whole projections, softmax
    top-k of 16 experts, not renormalised) at toy width."""
    return DeepSeekV3Config.from_hf_config(
        {
            "model_type": OLMOE.model_type,
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_experts": 16,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "max_position_embeddings": 512,
        }
    )


def olmoe_1b_7b() -> DeepSeekV3Config:
    """OLMoE-1B-7B: 16 layers, 8 of 64 experts of 1024, 16 heads (6.9B parameters, 1.3B
    active)."""
    return DeepSeekV3Config.from_hf_config(
        {
            "model_type": OLMOE.model_type,
            "vocab_size": 50304,
            "hidden_size": 2048,
            "intermediate_size": 1024,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "norm_topk_prob": False,
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        }
    )
