"""DeepSeek-V3 (and V2) at any size: config, model, multi-token prediction, presets, counts,
decoding with MLA's latent KV cache (`prefill`, `decode_step`, `generate`), and Hugging Face
checkpoints (loading, export, the parameter name mapping)."""

from dropless.models.deepseek_v3.config import DeepSeekV3Config
from dropless.models.deepseek_v3.decode import decode_step, prefill
from dropless.models.deepseek_v3.expert_bias import (
    expert_bias_state,
    step_expert_bias,
    with_updated_expert_bias,
)
from dropless.models.deepseek_v3.generate import generate, sample
from dropless.models.deepseek_v3.hf import (
    dropless_names,
    from_pretrained,
    hf_names,
    save_pretrained,
    to_hf,
)
from dropless.models.deepseek_v3.kv_cache import KVCache, init_cache
from dropless.models.deepseek_v3.layers import make_block, scan_blocks, stack_blocks, unstack
from dropless.models.deepseek_v3.model import (
    DeepSeekV3,
    ModelFeatures,
    ModelOutput,
    check_tokens,
    recorded_routing,
)
from dropless.models.deepseek_v3.mtp import MTP, MTPModule, mtp_targets
from dropless.models.deepseek_v3.params import ParamCount, count_params
from dropless.models.deepseek_v3.presets import PRESETS, get_preset
from dropless.models.deepseek_v3.routing_file import load_routing, save_routing

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
