"""gpt-oss sizes: a CPU toy and gpt-oss-20b exactly (its Hugging Face config.json)."""

from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.gpt_oss._config import GPT_OSS

_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def gpt_oss_tiny() -> DeepSeekV3Config:
    """About 1M parameters: gpt-oss's structure (sinks, biased GQA alternating a window of 64
    and full attention, a biased router to 2 of 8 experts with biases and the clamped SwiGLU)
    at toy width."""
    return DeepSeekV3Config.from_hf_config(
        {
            "model_type": GPT_OSS.model_type,
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
            "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
        }
    )


def gpt_oss_20b() -> DeepSeekV3Config:
    """gpt-oss-20b: 24 layers alternating a window of 128 and full attention, 4 of 32
    experts of 2880, 64 query and 8 key-value heads of 64, YaRN to 131072 positions (20.9B
    parameters, 3.6B active)."""
    return DeepSeekV3Config.from_hf_config(
        {
            "model_type": GPT_OSS.model_type,
            "vocab_size": 201088,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 24,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
            "max_position_embeddings": 131072,
            "rope_theta": 150000.0,
            "rope_scaling": _YARN,
            "rms_norm_eps": 1e-5,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": False,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
        }
    )
