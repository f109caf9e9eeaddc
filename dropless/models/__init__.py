"""Model families built from dropless's modules: DeepSeek-V3 (and V2, Kimi K2), and, as the
same decoder with grouped-query attention, Qwen3-MoE, Mixtral, OLMoE and gpt-oss."""

from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config, ModelOutput
from dropless.models.presets import PRESETS, get_preset

__all__ = ["PRESETS", "DeepSeekV3", "DeepSeekV3Config", "ModelOutput", "get_preset"]
