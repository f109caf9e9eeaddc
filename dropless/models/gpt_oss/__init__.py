"""gpt-oss: `DeepSeekV3` built with grouped-query attention (projection biases, a learnt
attention sink per head, sliding-window and full layers alternating), a router with a bias,
experts with biases and the clamped SwiGLU, and YaRN; its config.json mapping (`GPT_OSS`);
presets in `.presets` (the family's sizes, listed in `dropless.models.PRESETS`)."""

from dropless.models.gpt_oss._config import GPT_OSS

__all__ = ["GPT_OSS"]
