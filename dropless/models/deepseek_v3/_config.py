"""`DeepSeekV3Config`: the architecture, with Hugging Face field names, validated on creation."""

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from dropless._bias_update import BIAS_UPDATES, AbstractBiasUpdate, PIDBiasUpdate
from dropless._routing import RoutingSpec
from dropless.models.deepseek_v3._config_hf import DROPLESS_FIELDS, from_hf, to_hf
from dropless.models.deepseek_v3._config_rules import (
    ATTENTION_IMPLS,
    ATTENTION_TYPES,
    DTYPES,
    FAMILIES,
    GQA_FIELDS,
    LAYER_TYPES,
    MLA_TYPES,
    MODEL_TYPES,
    REMAT_POLICIES,
    SCORING_FUNCS,
    TOPK_METHODS,
    fail,
    validate,
)

# The field values, the rules and the Hugging Face conversion live in their own modules; they
# are importable from here, where the rest of the library names them.
__all__ = [
    "ATTENTION_IMPLS",
    "ATTENTION_TYPES",
    "DROPLESS_FIELDS",
    "DTYPES",
    "FAMILIES",
    "GQA_FIELDS",
    "LAYER_TYPES",
    "MLA_TYPES",
    "MODEL_TYPES",
    "REMAT_POLICIES",
    "SCORING_FUNCS",
    "TOPK_METHODS",
    "DeepSeekV3Config",
    "repeat_layer_types",
]


@dataclasses.dataclass(frozen=True)
class DeepSeekV3Config:
    """DeepSeek-V2/V3 architecture. Defaults are Hugging Face's `DeepseekV3Config` defaults (the
    671B shapes), so a `config.json` that omits a key means what it means there.

    topk_method: "noaux_tc" (V3: expert bias for selection, groups ranked by their top-2 sum),
    "group_limited_greedy" (V2: groups ranked by their best score) or "greedy" (no groups).
    The first `first_k_dense_replace` layers are dense SwiGLU (`intermediate_size`), the rest MoE.
    `attention_type` "gqa" replaces MLA by grouped-query attention (`dropless.nn.GQA`:
    `num_key_value_heads` and `head_dim`, None for one per query head and hidden_size /
    num_attention_heads; `qk_norm` "none" | "head" | "full"; `sliding_window`), as in the
    Qwen3-MoE, Mixtral and OLMoE families; `model_type` names the Hugging Face family whose
    checkpoints the config maps to ("deepseek_v3" or "kimi_k2", whose config.json is
    DeepSeek-V3's; "qwen3_moe", "mixtral", "olmoe", "gpt_oss": `dropless.models._hf_family`).
    gpt-oss adds `layer_types` (per layer "sliding_attention", which uses `sliding_window`, or
    "full_attention"; None: every layer uses `sliding_window`),
    `attention_bias` (GQA's projections), `attention_sinks` (a learnt sink logit per head),
    `router_bias`, `experts_bias` (the routed experts' projections) and `swiglu_limit` (None,
    or the clamped SwiGLU with `swiglu_alpha`).
    dropless settings: `param_dtype`/`compute_dtype` ("float32" | "bfloat16"; bf16 compute casts
    weights at use, norms, softmax and routing stay float32), `remat` ("none" | "full" | "dots" |
    "dots_no_batch", a `jax.checkpoint` policy per scanned layer), `attention_impl` ("xla"
    einsum attention, "blockwise" flash-style attention in plain JAX, or "cudnn" fused attention
    on NVIDIA GPUs: `dropless.nn.ATTENTIONS`), `unroll_layers` (unroll the
    scan over layers: no stacking of per-layer residuals, longer compiles) and `loss_chunk`
    (None, or positions per chunk of the training loss's vocabulary head: the loss then makes
    the logits and their gradient chunk by chunk, `dropless.train.head_cross_entropy`) and
    `logits_dtype` ("float32" | "bfloat16": what the vocabulary head's matmul writes, its
    accumulation float32 either way; the cross-entropy reduces in float32 either way) and
    `moe_weights_before_down` (the routing weights scale the experts' hidden units before the
    down projection instead of their outputs: `MoE(weights_before_down=True)`) and
    `bias_update` (the aux-loss-free bias rule of "noaux_tc" routers, a name of
    `dropless._bias_update.BIAS_UPDATES`: "sign", DeepSeek-V3's, "proportional", or "pid", whose
    gains are `bias_pid_kp`, `bias_pid_ki`, `bias_pid_kd`: `bias_update_rule()`) and
    LongCat-Flash's zero-computation experts: `n_zero_experts` more choices for the router,
    which return the token (`zero_expert_output="identity"`) or nothing ("zero") without a
    matmul, their biases steering the mean computing experts per token to
    `zero_expert_active` (None: k * experts / (experts + zero); see `MoE`).
    Training knobs (loss weights, bias update rate) live in `dropless.train.TrainConfig`.
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    topk_method: str = "noaux_tc"
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1
    # the Hugging Face family, and grouped-query attention (attention_type "gqa")
    model_type: str = "deepseek_v3"
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    sliding_window: int | None = None
    layer_types: Sequence[str] | None = None  # stored as a tuple
    attention_sinks: bool = False
    router_bias: bool = False
    experts_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # dropless settings
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    attention_impl: str = "xla"
    unroll_layers: bool = False
    loss_chunk: int | None = None
    logits_dtype: str = "float32"
    moe_weights_before_down: bool = False
    attention_type: str = "mla"
    qk_norm: str = "none"
    bias_update: str = "sign"
    bias_pid_kp: float = 1.0
    bias_pid_ki: float = 0.05
    bias_pid_kd: float = 0.0
    n_zero_experts: int = 0
    zero_expert_output: str = "identity"
    zero_expert_active: float | None = None

    def __post_init__(self):
        if self.rope_scaling is not None:  # a private copy: the caller's dict may change later
            if not isinstance(self.rope_scaling, Mapping):
                fail(
                    f"rope_scaling ({self.rope_scaling!r}) must be a mapping, e.g. "
                    "{'type': 'yarn', 'factor': 40}, or None"
                )
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        if self.layer_types is not None:  # a tuple, whatever config.json or YAML gave: hashable
            if isinstance(self.layer_types, str) or not isinstance(self.layer_types, Sequence):
                fail(f"layer_types ({self.layer_types!r}) must be a list of layer types, or None")
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        validate(self)

    def __hash__(self) -> int:  # rope_scaling is a dict; hash a frozen view of it
        scaling = tuple(sorted(self.rope_scaling.items())) if self.rope_scaling else None
        return hash(
            tuple(
                scaling if f.name == "rope_scaling" else getattr(self, f.name)
                for f in dataclasses.fields(self)
            )
        )

    # --- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Query and key width per head (MLA: nope + rope; GQA: `gqa_head_dim`)."""
        if self.attention_type == "gqa":
            return self.gqa_head_dim
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def value_head_dim(self) -> int:
        """Value width per head (MLA: `v_head_dim`; GQA: `gqa_head_dim`)."""
        return self.gqa_head_dim if self.attention_type == "gqa" else self.v_head_dim

    @property
    def gqa_head_dim(self) -> int:
        """GQA's head width: `head_dim`, or hidden_size / num_attention_heads when None."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """GQA's key-value heads: `num_key_value_heads`, or one per query head when None."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def n_dense_layers(self) -> int:
        return self.first_k_dense_replace

    @property
    def n_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def param_jnp_dtype(self):
        return DTYPES[self.param_dtype]

    @property
    def compute_jnp_dtype(self):
        return DTYPES[self.compute_dtype]

    @property
    def logits_jnp_dtype(self):
        return DTYPES[self.logits_dtype]

    def routing_spec(self) -> RoutingSpec:
        """The router settings implied by `topk_method` and the routing fields."""
        grouped = self.topk_method != "greedy"  # greedy ignores groups (DeepSeek-V2-Lite)
        return RoutingSpec(
            n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            scoring_func=self.scoring_func,
            n_group=self.n_group if grouped else 1,
            topk_group=self.topk_group if grouped else 1,
            group_score="max" if self.topk_method == "group_limited_greedy" else "top2_sum",
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            use_expert_bias=self.topk_method == "noaux_tc",
            router_bias=self.router_bias,
        )

    def bias_update_rule(self) -> AbstractBiasUpdate:
        """The expert-bias rule `bias_update` names (the PID rule with this config's gains)."""
        if self.bias_update == "pid":
            return PIDBiasUpdate(kp=self.bias_pid_kp, ki=self.bias_pid_ki, kd=self.bias_pid_kd)
        return BIAS_UPDATES[self.bias_update]

    def layer_windows(self) -> tuple[int, ...] | None:
        """Each layer's window under `layer_types` (a full layer's: 2**31 - 1, wider than any
        sequence), None without them (every layer uses `sliding_window`)."""
        if self.layer_types is None:
            return None
        full = 2**31 - 1
        return tuple(
            self.sliding_window if t == "sliding_attention" else full for t in self.layer_types
        )

    def replace(self, **changes: Any) -> "DeepSeekV3Config":
        """A copy with some fields changed (validated again). A new `num_hidden_layers` without
        new `layer_types` repeats the layer types' pattern (their shortest period: sliding,
        full for gpt-oss) to the new depth."""
        layers = changes.get("num_hidden_layers", self.num_hidden_layers)
        if self.layer_types and "layer_types" not in changes and layers != self.num_hidden_layers:
            changes["layer_types"] = repeat_layer_types(self.layer_types, layers)
        return dataclasses.replace(self, **changes)

    # --- Hugging Face config.json --------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> "DeepSeekV3Config":
        """From a Hugging Face config dict (DeepSeek-V2/V3, Kimi K2 or a family of `FAMILIES`);
        unknown keys are ignored.

        `overrides` set any field, e.g. the dropless settings, which config.json does not hold.
        """
        return from_hf(cls, hf, overrides)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> "DeepSeekV3Config":
        """From a Hugging Face `config.json` file."""
        with open(path) as f:
            return cls.from_hf_config(json.load(f), **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face config dict of `model_type`'s family (without dropless's own
        settings)."""
        return to_hf(self)


def repeat_layer_types(types: Sequence[str], layers: int) -> tuple[str, ...]:
    """`types`' repeating pattern (their shortest period) over `layers` layers."""
    period = next(
        p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types))
    )
    return tuple(types[i % period] for i in range(layers))
