"""The rules of `DeepSeekV3Config`: the values each field may take and the rules between
fields, checked on creation (`validate`), each failure one line naming the field and the rule."""

import math
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from dropless._bias_update import BIAS_UPDATES
from dropless._field_types import field_type_error, is_number
from dropless.models.gpt_oss._config import GPT_OSS
from dropless.models.mixtral._config import MIXTRAL
from dropless.models.olmoe._config import OLMOE
from dropless.models.qwen3_moe._config import QWEN3_MOE
from dropless.nn._attention import QK_NORMS
from dropless.nn._rope import ROPE_TYPES, rope_type

if TYPE_CHECKING:  # the config imports these rules
    from dropless.models.deepseek_v3._config import DeepSeekV3Config

TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
SCORING_FUNCS = ("sigmoid", "softmax")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_IMPLS = ("xla", "blockwise", "cudnn")
ATTENTION_TYPES = ("mla", "gqa")
LAYER_TYPES = ("sliding_attention", "full_attention")
# The fields of the grouped-query families (not in a deepseek_v3 config.json), with the values
# MLA models have.
GQA_FIELDS: dict[str, Any] = {
    "num_key_value_heads": None,
    "head_dim": None,
    "sliding_window": None,
    "layer_types": None,
    "attention_sinks": False,
    "router_bias": False,
    "experts_bias": False,
    "swiglu_limit": None,
    "swiglu_alpha": 1.702,
}
# The other Hugging Face families a config maps to, by model type (`dropless.models._hf_family`).
FAMILIES = {f.model_type: f for f in (QWEN3_MOE, MIXTRAL, OLMOE, GPT_OSS)}
# The model types whose config.json is DeepSeek-V3's: Kimi K2 names its own type, its
# architecture and every key DeepSeek-V3's.
MLA_TYPES = ("deepseek_v3", "kimi_k2")
MODEL_TYPES = (*MLA_TYPES, *FAMILIES)


def fail(rule: str) -> None:
    raise ValueError(f"DeepSeekV3Config: {rule}")


def validate(c: "DeepSeekV3Config") -> None:
    wrong_type = field_type_error(c)
    if wrong_type:
        fail(wrong_type)
    positive = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "n_routed_experts",
        "num_experts_per_tok",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "n_group",
        "topk_group",
        "max_position_embeddings",
    )
    for name in positive:
        if getattr(c, name) < 1:
            fail(f"{name} ({getattr(c, name)}) must be >= 1")
    for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
        if getattr(c, name) < 0:
            fail(f"{name} ({getattr(c, name)}) must be >= 0")
    if c.q_lora_rank is not None and c.q_lora_rank < 1:
        fail(f"q_lora_rank ({c.q_lora_rank}) must be >= 1, or None for a direct q_proj")
    if c.first_k_dense_replace > c.num_hidden_layers:
        fail(
            f"first_k_dense_replace ({c.first_k_dense_replace}) must be <= num_hidden_layers "
            f"({c.num_hidden_layers})"
        )
    if c.qk_rope_head_dim % 2:
        fail(f"qk_rope_head_dim ({c.qk_rope_head_dim}) must be even (rope rotates pairs)")
    _validate_routing(c)
    _validate_rope(c)
    if not 0 < c.rms_norm_eps < math.inf:
        fail(f"rms_norm_eps ({c.rms_norm_eps}) must be > 0 and finite")
    if c.hidden_act != "silu":
        fail(f"hidden_act ({c.hidden_act!r}) must be 'silu' (SwiGLU)")
    _validate_attention(c)
    if c.attention_bias and c.attention_type == "mla":
        fail("attention_bias (True) needs attention_type 'gqa': MLA's projections have no bias")
    if c.loss_chunk is not None and c.loss_chunk < 1:
        fail(f"loss_chunk ({c.loss_chunk}) must be >= 1, or None for one pass")
    for name, allowed in (
        ("param_dtype", tuple(DTYPES)),
        ("compute_dtype", tuple(DTYPES)),
        ("logits_dtype", tuple(DTYPES)),
        ("remat", REMAT_POLICIES),
        ("attention_impl", ATTENTION_IMPLS),
        ("bias_update", tuple(BIAS_UPDATES)),
        ("zero_expert_output", ("identity", "zero")),
    ):
        if getattr(c, name) not in allowed:
            fail(f"{name} ({getattr(c, name)!r}) must be one of {allowed}")


def _validate_attention(c: "DeepSeekV3Config") -> None:
    for name, allowed in (
        ("attention_type", ATTENTION_TYPES),
        ("qk_norm", QK_NORMS),
        ("model_type", MODEL_TYPES),
    ):
        if getattr(c, name) not in allowed:
            fail(f"{name} ({getattr(c, name)!r}) must be one of {allowed}")
    for name in ("num_key_value_heads", "head_dim", "sliding_window"):
        if getattr(c, name) is not None and getattr(c, name) < 1:
            fail(f"{name} ({getattr(c, name)}) must be >= 1, or None")
    if c.swiglu_limit is not None and not 0 < c.swiglu_limit < math.inf:
        fail(f"swiglu_limit ({c.swiglu_limit}) must be > 0 and finite, or None")
    if not 0 < c.swiglu_alpha < math.inf:
        fail(f"swiglu_alpha ({c.swiglu_alpha}) must be > 0 and finite")
    if c.moe_weights_before_down and (c.experts_bias or c.swiglu_limit is not None):
        fail("moe_weights_before_down needs experts_bias False and swiglu_limit None")
    if c.attention_sinks and c.attention_impl != "xla":
        fail(f"attention_sinks need attention_impl 'xla', not {c.attention_impl!r}")
    if c.attention_type == "mla":
        for name, default in (("qk_norm", "none"), ("sliding_window", None)):
            if getattr(c, name) != default:
                fail(f"{name} ({getattr(c, name)!r}) needs attention_type 'gqa'")
        for name in ("layer_types", "attention_sinks"):
            if getattr(c, name) != GQA_FIELDS[name]:
                fail(f"{name} ({getattr(c, name)!r}) needs attention_type 'gqa'")
        return
    if c.attention_impl == "blockwise":
        fail(
            "attention_impl 'blockwise' is MLA's; GQA (attention_type 'gqa') runs 'xla' or 'cudnn'"
        )
    if c.layer_types is not None:
        if len(c.layer_types) != c.num_hidden_layers or set(c.layer_types) - set(LAYER_TYPES):
            fail(
                f"layer_types ({list(c.layer_types)}) must name one of {LAYER_TYPES} for each "
                f"of the num_hidden_layers ({c.num_hidden_layers}) layers"
            )
        if "sliding_attention" in c.layer_types and c.sliding_window is None:
            fail("layer_types has sliding_attention layers: sliding_window must be set")
        if c.attention_impl != "xla":
            fail(f"layer_types need attention_impl 'xla', not {c.attention_impl!r}")
    if c.num_attention_heads % c.kv_heads:
        fail(
            f"num_attention_heads ({c.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({c.kv_heads})"
        )
    if c.gqa_head_dim < 2 or c.gqa_head_dim % 2:
        fail(f"head_dim ({c.gqa_head_dim}) must be even (rope rotates pairs)")


def _validate_routing(c: "DeepSeekV3Config") -> None:
    e, k = c.n_routed_experts, c.num_experts_per_tok
    if c.topk_method not in TOPK_METHODS:
        fail(f"topk_method ({c.topk_method!r}) must be one of {TOPK_METHODS}")
    if c.scoring_func not in SCORING_FUNCS:
        fail(f"scoring_func ({c.scoring_func!r}) must be one of {SCORING_FUNCS}")
    if k > e:
        fail(f"num_experts_per_tok ({k}) must be <= n_routed_experts ({e})")
    if not 0 < c.routed_scaling_factor < math.inf:
        fail(f"routed_scaling_factor ({c.routed_scaling_factor}) must be > 0 and finite")
    for name in ("bias_pid_kp", "bias_pid_ki", "bias_pid_kd"):
        if not 0 <= getattr(c, name) < math.inf:
            fail(f"{name} ({getattr(c, name)}) must be >= 0 and finite")
    if c.n_zero_experts < 0:
        fail(f"n_zero_experts ({c.n_zero_experts}) must be >= 0")
    if c.n_zero_experts and c.topk_method != "greedy" and c.n_group > 1:
        fail(
            f"n_zero_experts ({c.n_zero_experts}) needs routing without groups: n_group "
            f"({c.n_group}) must be 1, or topk_method 'greedy'"
        )
    active = c.zero_expert_active
    if active is not None and not 0 < active <= k:
        fail(f"zero_expert_active ({active}) must be in (0, num_experts_per_tok={k}]")
    if c.topk_method == "greedy":
        return  # groups are ignored
    if e % c.n_group:
        fail(f"n_routed_experts ({e}) must be divisible by n_group ({c.n_group})")
    if c.topk_group > c.n_group:
        fail(f"topk_group ({c.topk_group}) must be <= n_group ({c.n_group})")
    per_group = e // c.n_group
    if k > c.topk_group * per_group:
        fail(
            f"num_experts_per_tok ({k}) must be <= topk_group * n_routed_experts / n_group "
            f"({c.topk_group} * {per_group}), the experts that group-limited routing can reach"
        )
    if c.topk_method == "noaux_tc" and c.n_group > 1 and per_group < 2:
        fail(
            f"topk_method 'noaux_tc' ranks groups by their two best experts: n_routed_experts / "
            f"n_group ({e} / {c.n_group}) must be >= 2"
        )


def _validate_rope(c: "DeepSeekV3Config") -> None:
    if not c.rope_theta > 1:
        fail(f"rope_theta ({c.rope_theta}) must be > 1")
    s = c.rope_scaling
    if not s:
        return
    kind = rope_type(s)
    if kind not in ROPE_TYPES:
        fail(f"rope_scaling type ({kind!r}) must be one of {ROPE_TYPES}")
    if kind == "default":
        return
    for key in ("factor", "mscale", "mscale_all_dim", "attention_factor", "beta_fast", "beta_slow"):
        value = s.get(key)
        if value is not None and not (is_number(value) and math.isfinite(value)):
            fail(f"rope_scaling[{key!r}] ({value!r}) must be a finite number")
    original = s.get("original_max_position_embeddings")
    if original is not None and not (is_number(original) and float(original).is_integer()):
        fail(f"rope_scaling['original_max_position_embeddings'] ({original!r}) must be an int")
    if "factor" not in s or not s["factor"] >= 1:
        fail(f"rope_scaling['factor'] ({s.get('factor')}) must be given and >= 1")
    if kind == "yarn":
        original = s.get("original_max_position_embeddings", c.max_position_embeddings)
        if not original >= 1:
            fail(f"rope_scaling['original_max_position_embeddings'] ({original}) must be >= 1")
        fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
        if not fast >= slow > 0:
            fail(f"rope_scaling needs beta_fast >= beta_slow > 0, got {fast} and {slow}")
