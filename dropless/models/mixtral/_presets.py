"""Mixtral sizes: a CPU toy and Mixtral-8x7B exactly (its Hugging Face config.json)."""

from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.mixtral._config import MIXTRAL


def mixtral_tiny() -> DeepSeekV3Config:
    """About 1M parameters: Mixtral's structure (GQA, a sliding window, top-2 of 8 experts) at
    toy width."""
    return DeepSeekV3Config.from_hf_config(
        {
            "model_type": MIXTRAL.model_type,
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 512,
            "sliding_window": 64,
            "rope_theta": 1e6,
        }
    )


def mixtral_8x7b() -> DeepSeekV3Config:
    """Mixtral-8x7B: 32 layers, top-2 of 8 experts of 14336, 32 query and 8 key-value heads
    (46.7B parameters, 12.9B active)."""
    return DeepSeekV3Config.from_hf_config(
        {
            "model_type": MIXTRAL.model_type,
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 32768,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-5,
            "sliding_window": None,
            "tie_word_embeddings": False,
        }
    )
