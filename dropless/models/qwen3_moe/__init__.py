"""Qwen3-MoE: `DeepSeekV3` built with grouped-query attention (per-head QK norm) and softmax
top-k routing; its config.json mapping (`QWEN3_MOE`); presets in `.presets` (the family's
sizes, listed in `dropless.models.PRESETS`)."""

from dropless.models.qwen3_moe._config import QWEN3_MOE

__all__ = ["QWEN3_MOE"]
