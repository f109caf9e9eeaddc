"""The options of `dropless train`: the command's own, `TrainConfig`'s (flags without a prefix)
and `DeepSeekV3Config`'s (`--model.<field>`), as tyro parses them."""

import dataclasses
import json
from typing import Annotated, Any, Literal

import tyro

from dropless.cli._config_file import apply_overrides, parse_yaml
from dropless.models import PRESETS
from dropless.models.deepseek_v3 import DeepSeekV3Config
from dropless.models.deepseek_v3._config import repeat_layer_types
from dropless.train._config import TrainConfig

# One line per DeepSeekV3Config field, shown by `dropless train --help-all`.
MODEL_HELP = {
    "vocab_size": "Vocabulary size.",
    "hidden_size": "Model width (residual stream).",
    "intermediate_size": "Hidden width of the dense SwiGLU layers.",
    "moe_intermediate_size": "Hidden width of each routed (and shared) expert.",
    "num_hidden_layers": "Decoder layers in total (dense + MoE).",
    "num_attention_heads": "Attention heads.",
    "n_shared_experts": "Shared experts per MoE layer (every token visits them).",
    "n_routed_experts": "Routed experts per MoE layer.",
    "routed_scaling_factor": "Scale applied to the routed experts' combined output.",
    "kv_lora_rank": "MLA: rank of the compressed key/value latent.",
    "q_lora_rank": "MLA: rank of the compressed query (None: direct query projection).",
    "qk_rope_head_dim": "MLA: per-head query/key dims that carry rotary position (decoupled).",
    "v_head_dim": "MLA: per-head value dims.",
    "qk_nope_head_dim": "MLA: per-head query/key dims without rotary position.",
    "topk_method": "Routing: 'noaux_tc' (V3, expert bias + top-2-sum groups), "
    "'group_limited_greedy' (V2) or 'greedy' (no groups).",
    "n_group": "Routing: expert groups (group-limited routing).",
    "topk_group": "Routing: groups each token may use.",
    "num_experts_per_tok": "Routing: experts per token (top-k).",
    "first_k_dense_replace": "Leading dense layers before the MoE layers.",
    "norm_topk_prob": "Routing: renormalise the top-k weights to sum to one.",
    "scoring_func": "Routing: expert affinity, 'sigmoid' (V3) or 'softmax' (V2).",
    "hidden_act": "Feed-forward activation ('silu' only).",
    "max_position_embeddings": "Longest sequence the model supports.",
    "rms_norm_eps": "RMSNorm epsilon (MLA's latent norms keep 1e-6, as in DeepSeek's code).",
    "rope_theta": "Rotary embedding base.",
    "rope_scaling": "Rotary scaling as a YAML/JSON mapping, e.g. "
    "'{type: yarn, factor: 40, original_max_position_embeddings: 4096}', or None.",
    "rope_interleave": "Rotary pairs interleaved (DeepSeek checkpoints) rather than halves.",
    "attention_bias": "Bias in attention projections (unsupported; keep False).",
    "tie_word_embeddings": "Share the input embedding with the output head.",
    "num_nextn_predict_layers": "Multi-token-prediction modules (0: none).",
    "param_dtype": "Parameter dtype: 'float32' or 'bfloat16'.",
    "compute_dtype": "Compute dtype: 'float32' or 'bfloat16'.",
    "remat": "Rematerialisation per layer: 'none', 'full', 'dots', 'dots_no_batch'.",
    "attention_impl": "Attention: 'xla' or 'blockwise' (anywhere), 'cudnn' (NVIDIA GPUs).",
    "unroll_layers": "Unroll the scan over layers: faster steps on a GPU, longer compiles.",
    "loss_chunk": "Positions per chunk of the loss's vocabulary head (None: all at once); "
    "chunks never hold the whole float32 logits.",
    "logits_dtype": "What the vocabulary head writes: 'float32' or 'bfloat16' (the loss reduces "
    "in float32 either way).",
    "model_type": "Hugging Face family of the checkpoints: 'deepseek_v3', 'kimi_k2', "
    "'qwen3_moe', 'mixtral', 'olmoe' or 'gpt_oss'.",
    "num_key_value_heads": "GQA: key-value heads (None: one per query head).",
    "head_dim": "GQA: width of each head (None: hidden_size / num_attention_heads).",
    "sliding_window": "GQA: positions each query sees, itself included (None: all before it).",
    "layer_types": "GQA: each layer's 'sliding_attention' (sliding_window) or 'full_attention' "
    "(None: every layer uses sliding_window; gpt-oss).",
    "attention_sinks": "GQA: a learnt sink logit per head in the softmax (gpt-oss).",
    "router_bias": "The router's logits add a learnt bias (gpt-oss).",
    "experts_bias": "The routed experts' gate, up and down projections add biases (gpt-oss).",
    "swiglu_limit": "The experts' clamped SwiGLU's limit (None: the plain SwiGLU; gpt-oss).",
    "swiglu_alpha": "The clamped SwiGLU's sigmoid gain (gpt-oss: 1.702).",
    "attention_type": "Attention: 'mla' (DeepSeek) or 'gqa' (grouped-query: Qwen3-MoE, Mixtral, "
    "OLMoE, gpt-oss).",
    "qk_norm": "GQA: RMS norm of queries and keys: 'none', 'head' (per head, Qwen3) or 'full' "
    "(whole projections, OLMoE).",
    "moe_weights_before_down": "Routing weights scale the experts' hidden units before the "
    "down projection, not their outputs (the same function; no expert outputs kept for the "
    "backward).",
    "bias_update": "Aux-loss-free balancing rule of the expert bias: 'sign' (DeepSeek-V3), "
    "'proportional' or 'pid'.",
    "bias_pid_kp": "The 'pid' bias rule's proportional gain.",
    "bias_pid_ki": "The 'pid' bias rule's integral gain.",
    "bias_pid_kd": "The 'pid' bias rule's derivative gain.",
    "n_zero_experts": "Zero-computation experts (LongCat-Flash): more choices for the router, "
    "returning the token (or nothing) without a matmul.",
    "zero_expert_output": "What a zero-computation expert returns: 'identity' or 'zero'.",
    "zero_expert_active": "Computing experts per token that the zero-computation experts' "
    "biases steer to (None: the even share).",
}

PRESET_NAMES = tuple(PRESETS)


def _model_options_class() -> type:
    """A dataclass mirroring DeepSeekV3Config for the command line (`--model.<field>`), with a
    help line per field; `rope_scaling` is a YAML string there."""
    fields = []
    for field in dataclasses.fields(DeepSeekV3Config):
        kind = str | None if field.name == "rope_scaling" else field.type
        help_text = MODEL_HELP.get(field.name, f"DeepSeekV3Config.{field.name}.")
        fields.append((field.name, Annotated[kind, tyro.conf.arg(help=help_text)]))
    return dataclasses.make_dataclass("ModelOptions", fields, frozen=True)


ModelOptions = _model_options_class()


def to_options(config: DeepSeekV3Config) -> Any:
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(DeepSeekV3Config)}
    if values["rope_scaling"] is not None:
        values["rope_scaling"] = json.dumps(values["rope_scaling"])
    return ModelOptions(**values)


def from_options(options: Any) -> DeepSeekV3Config:
    values = dataclasses.asdict(options)
    if isinstance(values["rope_scaling"], str):
        parsed = parse_yaml(values["rope_scaling"], "--model.rope-scaling")
        if parsed is not None and not isinstance(parsed, dict):
            raise ValueError(f"--model.rope-scaling must be a mapping or None, got {parsed!r}")
        values["rope_scaling"] = parsed
    types, layers = values["layer_types"], values["num_hidden_layers"]
    if types is not None and len(types) != layers:  # a new depth: the preset's pattern repeats
        values["layer_types"] = repeat_layer_types(types, layers)
    elif types is not None:
        values["layer_types"] = tuple(types)
    return DeepSeekV3Config(**values)


@dataclasses.dataclass(frozen=True)
class TrainCommand:
    """Train a DeepSeek-V3-shaped MoE. Without options: the `tiny` preset on real text (the
    Python standard library's source and docs, byte-level), on CPU, in a couple of minutes;
    prints where results went (metrics JSONL, plots, checkpoints), tokens/s and a sample of
    what the model writes."""

    model: ModelOptions  # type: ignore[valid-type]
    """Model architecture (Hugging Face DeepSeek-V3 field names); defaults come from --preset
    and --config."""
    train: Annotated[TrainConfig, tyro.conf.OmitArgPrefixes]
    """Training settings."""
    preset: Literal[PRESET_NAMES] = "tiny"  # type: ignore[valid-type]
    """Model preset that the model options start from."""
    config: str | None = None
    """YAML file with (some of) the sections `preset`, `backend`, `model`, `train`, such as
    the config.yaml of a run; flags override it."""
    backend: str = "auto"
    """MoE backend: 'auto' (pallas on a Hopper GPU, te-gmm on other GPUs where TE imports,
    jnp-capacity on a GPU without it, else jnp), 'jnp', 'ragged', 'te', ..."""
    out_dir: str | None = None
    """Output directory (default: runs/<name>-<date>-<time>, the name that of the preset, of
    the --config file, or of the run whose config.yaml it is); --resume needs it, and
    continues the run with the settings of its config.yaml (flags override them)."""
    set: Annotated[tuple[str, ...], tyro.conf.arg(help_behavior_hint="(default: none)")] = ()
    """Dotted overrides applied last, values in YAML: --set model.n_routed_experts=32
    train.lr=1e-3."""
    progress: bool = True
    """Show a progress bar (without it, only the evaluations print, a line each)."""
    local_processes: int = 1
    """Run as this many JAX processes on this machine (multi-host code, tried anywhere): the
    same command in each, process 0 printing, the others logging to <out-dir>/process-<i>.log;
    on a CPU give each devices with XLA_FLAGS=--xla_force_host_platform_device_count=N."""
    sample: bool = True
    """At the end, print a short sample of what the model writes (a prompt from the eval split,
    continued at temperature 0.8), when the data has a tokenizer and the run used no mesh."""
    compile_cache: bool = True
    """Keep compiled steps in a persistent cache (~/.cache/dropless/jax, or
    $JAX_COMPILATION_CACHE_DIR), so later runs of the same shapes start in seconds."""

    def configs(self) -> tuple[DeepSeekV3Config, TrainConfig]:
        """The model and training configs these options describe (`--set` applied)."""
        return apply_overrides(from_options(self.model), self.train, self.set)


@dataclasses.dataclass(frozen=True)
class PresetsCommand:
    """List the model presets: parameter counts (total, active per token, MTP), layers, experts,
    top-k and widths."""
