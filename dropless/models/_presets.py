"""Every family's named sizes in one table: DeepSeek-V3's (`deepseek_v3.PRESETS`, Kimi K2
included), Qwen3-MoE's, Mixtral's, OLMoE's and gpt-oss's. `dropless presets` lists them."""

from collections.abc import Callable
from typing import Any

from dropless.models import deepseek_v3
from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.gpt_oss._presets import gpt_oss_20b, gpt_oss_tiny
from dropless.models.mixtral._presets import mixtral_8x7b, mixtral_tiny
from dropless.models.olmoe._presets import olmoe_1b_7b, olmoe_tiny
from dropless.models.qwen3_moe._presets import qwen3_30b_a3b, qwen3_moe_tiny

PRESETS: dict[str, Callable[[], DeepSeekV3Config]] = {
    **deepseek_v3.PRESETS,
    "qwen3-moe-tiny": qwen3_moe_tiny,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "mixtral-tiny": mixtral_tiny,
    "mixtral-8x7b": mixtral_8x7b,
    "olmoe-tiny": olmoe_tiny,
    "olmoe-1b-7b": olmoe_1b_7b,
    "gpt-oss-tiny": gpt_oss_tiny,
    "gpt-oss-20b": gpt_oss_20b,
}


def get_preset(name: str, **overrides: Any) -> DeepSeekV3Config:
    """The named preset of any family, with any fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    config = PRESETS[name]()
    return config.replace(**overrides) if overrides else config
