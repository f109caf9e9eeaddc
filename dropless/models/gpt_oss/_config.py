"""gpt-oss's `config.json` as a `DeepSeekV3Config`: grouped-query attention with biased
projections, attention sinks and `layer_types` (sliding-window and full layers); the router is
a linear layer with a bias whose top-k logits are softmaxed (softmax, top-k and renormalisation:
the same function); experts with biases and the clamped SwiGLU (`swiglu_limit`,
`swiglu_alpha`); rope in `rope_parameters` (YaRN in the releases)."""

from typing import Any

from dropless.models._hf_family import COMMON, GQA_MOE, HFFamily


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    out = dict(hf)
    if out.get("layer_types") is None:  # transformers' default: sliding first, then alternating
        layers = out["num_hidden_layers"]
        out["layer_types"] = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
        ]
    out["layer_types"] = tuple(out["layer_types"])  # hashable, as the config's field is
    theta = out.pop("rope_theta", None)
    if out.get("rope_parameters") is None and out.get("rope_scaling") is None:
        out["rope_parameters"] = {"rope_type": "yarn", **_YARN}
    if theta is not None:
        out["rope_theta"] = theta
    elif "rope_theta" not in (out.get("rope_parameters") or {}):
        out["rope_theta"] = 150000.0  # transformers' default
    return out


def _write(out: dict[str, Any], config: Any) -> None:
    # transformers reads a gpt-oss config without rope parameters as YaRN: say "default"
    scaling = out.pop("rope_scaling") or {"rope_type": "default"}
    out["rope_parameters"] = {**scaling, "rope_theta": config.rope_theta}
    out["layer_types"] = list(config.layer_types) if config.layer_types else None
    out["attention_bias"] = config.attention_bias


# transformers' GptOssConfig defaults for rope (the released checkpoints' YaRN)
_YARN = {
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

GPT_OSS = HFFamily(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    renames={
        "num_local_experts": "n_routed_experts",
        "num_experts": "n_routed_experts",
        "intermediate_size": "moe_intermediate_size",
    },
    defaults={
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
    },
    fixed={
        **{k: v for k, v in GQA_MOE.items() if k not in ("layer_types", "swiglu_limit")},
        "qk_norm": "none",
        "norm_topk_prob": True,
        "first_k_dense_replace": 0,
        "attention_bias": True,
        "attention_sinks": True,
        "router_bias": True,
        "experts_bias": True,
    },
    exported=(
        *COMMON,
        "intermediate_size",
        "num_local_experts",
        "sliding_window",
        "swiglu_limit",
        "swiglu_alpha",
    ),
    read=_read,
    write=_write,
)
