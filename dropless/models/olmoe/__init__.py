"""OLMoE: `DeepSeekV3` built with grouped-query attention (QK norm over whole projections)
and softmax top-k routing; its config.json mapping (`OLMOE`); presets in `.presets` (the family's
sizes, listed in `dropless.models.PRESETS`)."""

from dropless.models.olmoe._config import OLMOE

__all__ = ["OLMOE"]
