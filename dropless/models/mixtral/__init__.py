"""Mixtral: `DeepSeekV3` built with grouped-query attention (optional sliding window) and
top-k softmax routing; its config.json mapping (`MIXTRAL`); presets in `.presets` (the family's
sizes, listed in `dropless.models.PRESETS`)."""

from dropless.models.mixtral._config import MIXTRAL

__all__ = ["MIXTRAL"]
