"""Model families built from dropless's modules."""

from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config, ModelOutput, get_preset

__all__ = ["DeepSeekV3", "DeepSeekV3Config", "ModelOutput", "get_preset"]
