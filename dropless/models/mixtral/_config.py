"""Mixtral's `config.json` as a `DeepSeekV3Config`: grouped-query attention with an optional
sliding window; the router softmaxes its top-k logits, which is softmax then top-k then
renormalisation (`norm_topk_prob`): the same function of the logits."""

from typing import Any

from dropless.models._hf_family import COMMON, GQA_MOE, HFFamily


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("router_jitter_noise"):
        raise ValueError(f"router_jitter_noise ({hf['router_jitter_noise']}) must be 0")
    return hf


MIXTRAL = HFFamily(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    renames={"num_local_experts": "n_routed_experts", "intermediate_size": "moe_intermediate_size"},
    defaults={
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
    fixed={**GQA_MOE, "qk_norm": "none", "norm_topk_prob": True, "first_k_dense_replace": 0},
    exported=(*COMMON, "intermediate_size", "num_local_experts", "sliding_window"),
    read=_read,
)
