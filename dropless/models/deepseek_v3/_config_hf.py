"""`DeepSeekV3Config` to and from a Hugging Face config dict: DeepSeek-V2/V3 and Kimi K2
(config.json's keys are the config's field names) and the families of `FAMILIES`."""

import dataclasses
from typing import TYPE_CHECKING, Any

from dropless.models.deepseek_v3._config_rules import FAMILIES, GQA_FIELDS, MLA_TYPES, fail
from dropless.nn._rope import rope_type

if TYPE_CHECKING:  # the config imports this conversion
    from dropless.models.deepseek_v3._config import DeepSeekV3Config

# Settings that are dropless's own (not in a Hugging Face config.json).
DROPLESS_FIELDS = (
    "param_dtype",
    "compute_dtype",
    "remat",
    "attention_impl",
    "unroll_layers",
    "loss_chunk",
    "logits_dtype",
    "moe_weights_before_down",
    "attention_type",
    "qk_norm",
    "bias_update",
    "bias_pid_kp",
    "bias_pid_ki",
    "bias_pid_kd",
    "zero_expert_output",
    "zero_expert_active",
)

# A `model_type: deepseek_v2` config.json leaves these at DeepSeek-V2's defaults, not V3's.
_V2_DEFAULTS: dict[str, Any] = {
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
}


def from_hf(
    cls: type["DeepSeekV3Config"], hf: dict[str, Any], overrides: dict[str, Any]
) -> "DeepSeekV3Config":
    """From a Hugging Face config dict (DeepSeek-V2/V3, Kimi K2 or a family of `FAMILIES`);
    unknown keys are ignored.

    `overrides` set any field, e.g. the dropless settings, which config.json does not hold.
    """
    model_type = hf.get("model_type", "deepseek_v3")
    if model_type in FAMILIES:
        values = FAMILIES[model_type].from_hf(hf)
    else:
        values = dict(_V2_DEFAULTS) if model_type == "deepseek_v2" else {}
        values.update(hf, model_type=model_type if model_type in MLA_TYPES else "deepseek_v3")
        for name in GQA_FIELDS:
            values.pop(name, None)  # MLA's heads: not grouped-query attention's fields
    if "rope_parameters" in values and "rope_scaling" not in values:  # transformers >= 5
        params = dict(values["rope_parameters"])
        values.setdefault("rope_theta", params.pop("rope_theta", 10000.0))
        values["rope_scaling"] = params if rope_type(params) != "default" else None
    for name in ("n_group", "topk_group"):  # V2 writes null for "no groups"
        if name in values and values[name] is None:
            values[name] = 1
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        fail(f"from_hf_config: unknown field(s) {', '.join(unknown)} in the overrides")
    values.update(overrides)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name in values:
            value = values[field.name]
            if field.type is float and isinstance(value, int):
                value = float(value)  # JSON writes 10000.0 as 10000
            kwargs[field.name] = value
    return cls(**kwargs)


def to_hf(config: "DeepSeekV3Config") -> dict[str, Any]:
    """A Hugging Face config dict of `model_type`'s family (without dropless's own
    settings)."""
    if config.model_type not in MLA_TYPES:
        return FAMILIES[config.model_type].to_hf(config)
    if config.attention_type != "mla":
        fail(f"a {config.model_type} checkpoint has attention_type 'mla'")
    gqa = ("model_type", *GQA_FIELDS)
    names = [f.name for f in dataclasses.fields(config)]
    out = {f: getattr(config, f) for f in names if f not in DROPLESS_FIELDS + gqa}
    out["rope_scaling"] = dict(config.rope_scaling) if config.rope_scaling else None
    out["model_type"] = config.model_type
    out["architectures"] = ["DeepseekV3ForCausalLM"]
    out["num_key_value_heads"] = config.num_attention_heads
    return out
