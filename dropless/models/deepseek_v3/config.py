"""`DeepSeekV3Config`: the architecture, with Hugging Face field names, validated on creation."""

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from dropless.bias_update import BIAS_UPDATES, AbstractBiasUpdate, PIDBiasUpdate
from dropless.field_types import field_type_error, is_number
from dropless.models.gpt_oss.config import GPT_OSS
from dropless.models.mixtral.config import MIXTRAL
from dropless.models.olmoe.config import OLMOE
from dropless.models.qwen3_moe.config import QWEN3_MOE
from dropless.nn.attention import QK_NORMS
from dropless.nn.rope import ROPE_TYPES, rope_type
from dropless.routing import RoutingSpec

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
# The other Hugging Face families a config maps to, by model type (`dropless.models.hf_family`).
FAMILIES = {f.model_type: f for f in (QWEN3_MOE, MIXTRAL, OLMOE, GPT_OSS)}
# The model types whose config.json is DeepSeek-V3's: Kimi K2 names its own type, its
# architecture and every key DeepSeek-V3's.
MLA_TYPES = ("deepseek_v3", "kimi_k2")
MODEL_TYPES = (*MLA_TYPES, *FAMILIES)

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
    DeepSeek-V3's; "qwen3_moe", "mixtral", "olmoe", "gpt_oss": `dropless.models.hf_family`).
    gpt-oss adds `layer_types` (per layer "sliding_attention", which uses `sliding_window`, or
    "full_attention"; None: every layer uses `sliding_window`),
    `attention_bias` (GQA's projections), `attention_sinks` (a learnt sink logit per head),
    `router_bias`, `experts_bias` (the routed experts' projections) and `swiglu_limit` (None,
    or the clamped SwiGLU with `swiglu_alpha`).
    dropless settings: `param_dtype`/`compute_dtype` ("float32" | "bfloat16"; bf16 compute casts
    weights at use, norms, softmax and routing stay float32), `remat` ("none" | "full" | "dots" |
    "dots_no_batch", a `jax.checkpoint` policy per scanned layer), `attention_impl` ("xla"
    einsum attention, "blockwise" flash-style attention in plain JAX, or "cudnn" fused attention
    on NVIDIA GPUs: `dropless.nn.mla.ATTENTIONS`), `unroll_layers` (unroll the
    scan over layers: no stacking of per-layer residuals, longer compiles) and `loss_chunk`
    (None, or positions per chunk of the training loss's vocabulary head: the loss then makes
    the logits and their gradient chunk by chunk, `dropless.train.head_cross_entropy`) and
    `logits_dtype` ("float32" | "bfloat16": what the vocabulary head's matmul writes, its
    accumulation float32 either way; the cross-entropy reduces in float32 either way) and
    `moe_weights_before_down` (the routing weights scale the experts' hidden units before the
    down projection instead of their outputs: `MoE(weights_before_down=True)`) and
    `bias_update` (the aux-loss-free bias rule of "noaux_tc" routers, a name of
    `dropless.bias_update.BIAS_UPDATES`: "sign", DeepSeek-V3's, "proportional", or "pid", whose
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
                _fail(
                    f"rope_scaling ({self.rope_scaling!r}) must be a mapping, e.g. "
                    "{'type': 'yarn', 'factor': 40}, or None"
                )
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        if self.layer_types is not None:  # a tuple, whatever config.json or YAML gave: hashable
            if isinstance(self.layer_types, str) or not isinstance(self.layer_types, Sequence):
                _fail(f"layer_types ({self.layer_types!r}) must be a list of layer types, or None")
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        _validate(self)

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
        unknown = sorted(set(overrides) - set(_names()))
        if unknown:
            _fail(f"from_hf_config: unknown field(s) {', '.join(unknown)} in the overrides")
        values.update(overrides)
        kwargs = {}
        for field in dataclasses.fields(cls):
            if field.name in values:
                value = values[field.name]
                if field.type is float and isinstance(value, int):
                    value = float(value)  # JSON writes 10000.0 as 10000
                kwargs[field.name] = value
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> "DeepSeekV3Config":
        """From a Hugging Face `config.json` file."""
        with open(path) as f:
            return cls.from_hf_config(json.load(f), **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face config dict of `model_type`'s family (without dropless's own
        settings)."""
        if self.model_type not in MLA_TYPES:
            return FAMILIES[self.model_type].to_hf(self)
        if self.attention_type != "mla":
            _fail(f"a {self.model_type} checkpoint has attention_type 'mla'")
        gqa = ("model_type", *GQA_FIELDS)
        out = {f: getattr(self, f) for f in _names() if f not in DROPLESS_FIELDS + gqa}
        out["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        out["model_type"] = self.model_type
        out["architectures"] = ["DeepseekV3ForCausalLM"]
        out["num_key_value_heads"] = self.num_attention_heads
        return out


def repeat_layer_types(types: Sequence[str], layers: int) -> tuple[str, ...]:
    """`types`' repeating pattern (their shortest period) over `layers` layers."""
    period = next(
        p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types))
    )
    return tuple(types[i % period] for i in range(layers))


def _names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(DeepSeekV3Config))


def _fail(rule: str) -> None:
    raise ValueError(f"DeepSeekV3Config: {rule}")


def _validate(c: DeepSeekV3Config) -> None:
    wrong_type = field_type_error(c)
    if wrong_type:
        _fail(wrong_type)
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
            _fail(f"{name} ({getattr(c, name)}) must be >= 1")
    for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
        if getattr(c, name) < 0:
            _fail(f"{name} ({getattr(c, name)}) must be >= 0")
    if c.q_lora_rank is not None and c.q_lora_rank < 1:
        _fail(f"q_lora_rank ({c.q_lora_rank}) must be >= 1, or None for a direct q_proj")
    if c.first_k_dense_replace > c.num_hidden_layers:
        _fail(
            f"first_k_dense_replace ({c.first_k_dense_replace}) must be <= num_hidden_layers "
            f"({c.num_hidden_layers})"
        )
    if c.qk_rope_head_dim % 2:
        _fail(f"qk_rope_head_dim ({c.qk_rope_head_dim}) must be even (rope rotates pairs)")
    _validate_routing(c)
    _validate_rope(c)
    if not 0 < c.rms_norm_eps < math.inf:
        _fail(f"rms_norm_eps ({c.rms_norm_eps}) must be > 0 and finite")
    if c.hidden_act != "silu":
        _fail(f"hidden_act ({c.hidden_act!r}) must be 'silu' (SwiGLU)")
    _validate_attention(c)
    if c.attention_bias and c.attention_type == "mla":
        _fail("attention_bias (True) needs attention_type 'gqa': MLA's projections have no bias")
    if c.loss_chunk is not None and c.loss_chunk < 1:
        _fail(f"loss_chunk ({c.loss_chunk}) must be >= 1, or None for one pass")
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
            _fail(f"{name} ({getattr(c, name)!r}) must be one of {allowed}")


def _validate_attention(c: DeepSeekV3Config) -> None:
    for name, allowed in (
        ("attention_type", ATTENTION_TYPES),
        ("qk_norm", QK_NORMS),
        ("model_type", MODEL_TYPES),
    ):
        if getattr(c, name) not in allowed:
            _fail(f"{name} ({getattr(c, name)!r}) must be one of {allowed}")
    for name in ("num_key_value_heads", "head_dim", "sliding_window"):
        if getattr(c, name) is not None and getattr(c, name) < 1:
            _fail(f"{name} ({getattr(c, name)}) must be >= 1, or None")
    if c.swiglu_limit is not None and not 0 < c.swiglu_limit < math.inf:
        _fail(f"swiglu_limit ({c.swiglu_limit}) must be > 0 and finite, or None")
    if not 0 < c.swiglu_alpha < math.inf:
        _fail(f"swiglu_alpha ({c.swiglu_alpha}) must be > 0 and finite")
    if c.moe_weights_before_down and (c.experts_bias or c.swiglu_limit is not None):
        _fail("moe_weights_before_down needs experts_bias False and swiglu_limit None")
    if c.attention_sinks and c.attention_impl != "xla":
        _fail(f"attention_sinks need attention_impl 'xla', not {c.attention_impl!r}")
    if c.attention_type == "mla":
        for name, default in (("qk_norm", "none"), ("sliding_window", None)):
            if getattr(c, name) != default:
                _fail(f"{name} ({getattr(c, name)!r}) needs attention_type 'gqa'")
        for name in ("layer_types", "attention_sinks"):
            if getattr(c, name) != GQA_FIELDS[name]:
                _fail(f"{name} ({getattr(c, name)!r}) needs attention_type 'gqa'")
        return
    if c.attention_impl == "blockwise":
        _fail(
            "attention_impl 'blockwise' is MLA's; GQA (attention_type 'gqa') runs 'xla' or 'cudnn'"
        )
    if c.layer_types is not None:
        if len(c.layer_types) != c.num_hidden_layers or set(c.layer_types) - set(LAYER_TYPES):
            _fail(
                f"layer_types ({list(c.layer_types)}) must name one of {LAYER_TYPES} for each "
                f"of the num_hidden_layers ({c.num_hidden_layers}) layers"
            )
        if "sliding_attention" in c.layer_types and c.sliding_window is None:
            _fail("layer_types has sliding_attention layers: sliding_window must be set")
        if c.attention_impl != "xla":
            _fail(f"layer_types need attention_impl 'xla', not {c.attention_impl!r}")
    if c.num_attention_heads % c.kv_heads:
        _fail(
            f"num_attention_heads ({c.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({c.kv_heads})"
        )
    if c.gqa_head_dim < 2 or c.gqa_head_dim % 2:
        _fail(f"head_dim ({c.gqa_head_dim}) must be even (rope rotates pairs)")


def _validate_routing(c: DeepSeekV3Config) -> None:
    e, k = c.n_routed_experts, c.num_experts_per_tok
    if c.topk_method not in TOPK_METHODS:
        _fail(f"topk_method ({c.topk_method!r}) must be one of {TOPK_METHODS}")
    if c.scoring_func not in SCORING_FUNCS:
        _fail(f"scoring_func ({c.scoring_func!r}) must be one of {SCORING_FUNCS}")
    if k > e:
        _fail(f"num_experts_per_tok ({k}) must be <= n_routed_experts ({e})")
    if not 0 < c.routed_scaling_factor < math.inf:
        _fail(f"routed_scaling_factor ({c.routed_scaling_factor}) must be > 0 and finite")
    for name in ("bias_pid_kp", "bias_pid_ki", "bias_pid_kd"):
        if not 0 <= getattr(c, name) < math.inf:
            _fail(f"{name} ({getattr(c, name)}) must be >= 0 and finite")
    if c.n_zero_experts < 0:
        _fail(f"n_zero_experts ({c.n_zero_experts}) must be >= 0")
    if c.n_zero_experts and c.topk_method != "greedy" and c.n_group > 1:
        _fail(
            f"n_zero_experts ({c.n_zero_experts}) needs routing without groups: n_group "
            f"({c.n_group}) must be 1, or topk_method 'greedy'"
        )
    active = c.zero_expert_active
    if active is not None and not 0 < active <= k:
        _fail(f"zero_expert_active ({active}) must be in (0, num_experts_per_tok={k}]")
    if c.topk_method == "greedy":
        return  # groups are ignored
    if e % c.n_group:
        _fail(f"n_routed_experts ({e}) must be divisible by n_group ({c.n_group})")
    if c.topk_group > c.n_group:
        _fail(f"topk_group ({c.topk_group}) must be <= n_group ({c.n_group})")
    per_group = e // c.n_group
    if k > c.topk_group * per_group:
        _fail(
            f"num_experts_per_tok ({k}) must be <= topk_group * n_routed_experts / n_group "
            f"({c.topk_group} * {per_group}), the experts that group-limited routing can reach"
        )
    if c.topk_method == "noaux_tc" and c.n_group > 1 and per_group < 2:
        _fail(
            f"topk_method 'noaux_tc' ranks groups by their two best experts: n_routed_experts / "
            f"n_group ({e} / {c.n_group}) must be >= 2"
        )


def _validate_rope(c: DeepSeekV3Config) -> None:
    if not c.rope_theta > 1:
        _fail(f"rope_theta ({c.rope_theta}) must be > 1")
    s = c.rope_scaling
    if not s:
        return
    kind = rope_type(s)
    if kind not in ROPE_TYPES:
        _fail(f"rope_scaling type ({kind!r}) must be one of {ROPE_TYPES}")
    if kind == "default":
        return
    for key in ("factor", "mscale", "mscale_all_dim", "attention_factor", "beta_fast", "beta_slow"):
        value = s.get(key)
        if value is not None and not (is_number(value) and math.isfinite(value)):
            _fail(f"rope_scaling[{key!r}] ({value!r}) must be a finite number")
    original = s.get("original_max_position_embeddings")
    if original is not None and not (is_number(original) and float(original).is_integer()):
        _fail(f"rope_scaling['original_max_position_embeddings'] ({original!r}) must be an int")
    if "factor" not in s or not s["factor"] >= 1:
        _fail(f"rope_scaling['factor'] ({s.get('factor')}) must be given and >= 1")
    if kind == "yarn":
        original = s.get("original_max_position_embeddings", c.max_position_embeddings)
        if not original >= 1:
            _fail(f"rope_scaling['original_max_position_embeddings'] ({original}) must be >= 1")
        fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
        if not fast >= slow > 0:
            _fail(f"rope_scaling needs beta_fast >= beta_slow > 0, got {fast} and {slow}")
