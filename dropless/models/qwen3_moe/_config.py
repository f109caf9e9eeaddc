"""Qwen3-MoE's `config.json` as a `DeepSeekV3Config`: grouped-query attention with a per-head
RMS norm of queries and keys, softmax top-k routing (renormalised under `norm_topk_prob`)."""

from typing import Any

from dropless.models._hf_family import COMMON, GQA_MOE, HFFamily


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    # Dense layers are those in `mlp_only_layers` or off the `decoder_sparse_step` grid; the
    # dropless decoder puts them first.
    layers = hf["num_hidden_layers"]
    step = hf.get("decoder_sparse_step") or 1
    only = set(hf.get("mlp_only_layers") or ())
    dense = [i for i in range(layers) if i in only or (i + 1) % step]
    if dense != list(range(len(dense))):
        raise ValueError(
            f"dense layers {dense} (mlp_only_layers, decoder_sparse_step) must come first"
        )
    out = dict(hf, first_k_dense_replace=len(dense))
    if not hf.get("use_sliding_window"):
        out["sliding_window"] = None
    return out


def _write(out: dict[str, Any], config: Any) -> None:
    out["mlp_only_layers"] = list(range(config.first_k_dense_replace))
    out["decoder_sparse_step"] = 1
    out["use_sliding_window"] = config.sliding_window is not None


QWEN3_MOE = HFFamily(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    renames={"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts"},
    defaults={
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    fixed={**GQA_MOE, "qk_norm": "head"},
    exported=(
        *COMMON,
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "norm_topk_prob",
        "sliding_window",
    ),
    read=_read,
    write=_write,
)
