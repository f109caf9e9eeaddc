"""DeepSeek-V3 (and V2) at any size: config, model, multi-token prediction, presets, counts,
decoding with MLA's latent KV cache (`prefill`, `decode_step`, `generate`), and Hugging Face
checkpoints (loading, export, the parameter name mapping)."""

from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.deepseek_v3._decode import decode_step, prefill
from dropless.models.deepseek_v3._expert_bias import (
    expert_bias_state,
    step_expert_bias,
    with_updated_expert_bias,
)
from dropless.models.deepseek_v3._generate import generate, sample
from dropless.models.deepseek_v3._kv_cache import KVCache, init_cache
from dropless.models.deepseek_v3._layers import make_block, scan_blocks, stack_blocks, unstack
from dropless.models.deepseek_v3._model import (
    DeepSeekV3,
    ModelFeatures,
    ModelOutput,
    check_tokens,
    recorded_routing,
)
from dropless.models.deepseek_v3._mtp import MTP, MTPModule, mtp_targets
from dropless.models.deepseek_v3._params import ParamCount, count_params
from dropless.models.deepseek_v3._presets import PRESETS, get_preset
from dropless.models.deepseek_v3._routing_file import load_routing, save_routing
from dropless.models.deepseek_v3.hf import (
    dropless_names,
    from_pretrained,
    hf_names,
    save_pretrained,
    to_hf,
)

__all__ = [
    "MTP",
    "PRESETS",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "KVCache",
    "MTPModule",
    "ModelFeatures",
    "ModelOutput",
    "ParamCount",
    "check_tokens",
    "count_params",
    "decode_step",
    "dropless_names",
    "from_pretrained",
    "generate",
    "get_preset",
    "load_routing",
    "save_routing",
    "hf_names",
    "init_cache",
    "make_block",
    "mtp_targets",
    "prefill",
    "sample",
    "save_pretrained",
    "scan_blocks",
    "stack_blocks",
    "to_hf",
    "unstack",
    "recorded_routing",
    "expert_bias_state",
    "step_expert_bias",
    "with_updated_expert_bias",
]
