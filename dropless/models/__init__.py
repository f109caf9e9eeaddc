"""Model families built from dropless's modules: DeepSeek-V3 (and V2, Kimi K2), and, as the
same decoder with grouped-query attention, Qwen3-MoE, Mixtral, OLMoE and gpt-oss."""

from dropless.models._hf_family import HFFamily
from dropless.models._presets import PRESETS, get_preset
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config, ModelOutput

__all__ = ["PRESETS", "DeepSeekV3", "DeepSeekV3Config", "HFFamily", "ModelOutput", "get_preset"]
