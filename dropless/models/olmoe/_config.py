"""OLMoE's `config.json` as a `DeepSeekV3Config`: grouped-query attention with an RMS norm over
the whole query and key projections, softmax then top-k routing, not renormalised by
default."""

from typing import Any

from dropless.models._hf_family import COMMON, GQA_MOE, HFFamily


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv ({hf['clip_qkv']}) must be null: dropless does not clip")
    return hf


OLMOE = HFFamily(
    model_type="olmoe",
    architecture="OlmoeForCausalLM",
    renames={
        "num_experts": "n_routed_experts",
        "num_local_experts": "n_routed_experts",
        "intermediate_size": "moe_intermediate_size",
    },
    defaults={
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": None,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    fixed={**GQA_MOE, "qk_norm": "full", "first_k_dense_replace": 0, "sliding_window": None},
    exported=(*COMMON, "intermediate_size", "num_experts", "norm_topk_prob"),
    read=_read,
)
