"""The glossary of dimension names used in every jaxtyping annotation.

jaxtyping prints these names in its errors, so each size that code reasons about gets a word of
its own. docs/conventions.md carries the same names, with the local ones a single module uses.
"""

GLOSSARY: dict[str, str] = {
    "batch": "sequences in a batch",
    "seq": "positions in a sequence",
    "window": "seq + 1 tokens of a training window (inputs and next-token targets)",
    "tokens": "flattened batch * seq positions: the MoE layer's unit of work",
    "dim": "model (residual stream) width, `hidden_size` in Hugging Face configs",
    "hidden": "inner width of a SwiGLU feed-forward network (`intermediate_size`, "
    "`moe_intermediate_size`)",
    "experts": "routed experts (`n_routed_experts`), or the experts held by one device under EP",
    "k": "experts chosen per token (`num_experts_per_tok`)",
    "copies": "tokens * k: one row per (token, chosen expert) pair",
    "rows": "rows of an expert-contiguous buffer, >= the copies it holds (padding, EP buffers)",
    "groups": "expert groups for group-limited routing (`n_group`)",
    "heads": "attention heads",
    "vocab": "vocabulary size",
    "layers": "stacked (scanned) decoder layers",
    "depth": "multi-token-prediction modules (`num_nextn_predict_layers`)",
    "half": "half of a rotary dimension (one frequency per pair)",
    "rope": "per-head query/key dims carrying rotary position (`qk_rope_head_dim`)",
    "q_rank": "MLA compressed query width (`q_lora_rank`)",
    "q_out": "MLA query projection output: heads * (qk_nope_head_dim + qk_rope_head_dim)",
    "kv_rank": "MLA compressed key/value width (`kv_lora_rank`)",
    "kv_a_out": "MLA kv down-projection output: kv_lora_rank + qk_rope_head_dim",
    "kv_b_out": "MLA kv up-projection output: heads * (qk_nope_head_dim + v_head_dim)",
    "o_in": "MLA output projection input: heads * v_head_dim",
    "two_dim": "2 * dim: the MTP projection input [embedding | hidden]",
    "head_out": "width of what the MTP modules' shared head returns (vocab; dim for an identity)",
    "in_": "input width of a grouped matmul",
    "out": "output width of a grouped matmul",
}
