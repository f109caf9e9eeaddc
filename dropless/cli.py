"""The `dropless` command (also `python -m dropless`): a thin layer from options to `train`.

    dropless train                                   # tiny preset, synthetic corpus, CPU, ~2 min
    dropless train --preset small --steps 2000 --backend jnp --out-dir runs/small
    dropless train --config runs/small/config.yaml --model.n-routed-experts 32
    dropless train --set model.n_routed_experts=32 train.lr=1e-3
    dropless train --out-dir runs/small --resume --steps 4000
    dropless train --mesh data=2,expert=4            # sharded over 8 devices, experts over 4
    dropless presets                                 # the model presets and their sizes

Precedence, lowest first: the preset, a YAML `--config` (sections `preset`, `backend`, `model`,
`train`: the `config.yaml` every run writes; `--resume` reads the run's own), the flags, `--set`.
"""

import dataclasses
import inspect
import json
import os
import sys
import time
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union

import tyro
import yaml

from dropless.backends import BACKENDS, BackendUnavailableError
from dropless._allocator import keep_freed_memory
from dropless.models.deepseek_v3 import PRESETS, DeepSeekV3Config, get_preset
from dropless.train.config import TrainConfig

# One line per DeepSeekV3Config field, shown by `dropless train --help`.
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
    "attention_impl": "Attention: 'xla' (anywhere) or 'cudnn' (NVIDIA GPUs).",
    "unroll_layers": "Unroll the scan over layers: faster steps on a GPU, longer compiles.",
    "loss_chunk": "Positions per chunk of the loss's vocabulary head (None: all at once); "
    "chunks never hold the whole float32 logits.",
    "logits_dtype": "What the vocabulary head writes: 'float32' or 'bfloat16' (the loss reduces "
    "in float32 either way).",
    "moe_weights_before_down": "Routing weights scale the experts' hidden units before the "
    "down projection, not their outputs (the same function; no expert outputs kept for the "
    "backward).",
}

_PRESET_NAMES = tuple(PRESETS)
_BACKEND_NAMES = ("auto", *BACKENDS)
_SECTIONS = ("preset", "backend", "model", "train")


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


def _to_options(config: DeepSeekV3Config) -> Any:
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(DeepSeekV3Config)}
    if values["rope_scaling"] is not None:
        values["rope_scaling"] = json.dumps(values["rope_scaling"])
    return ModelOptions(**values)


def _from_options(options: Any) -> DeepSeekV3Config:
    values = dataclasses.asdict(options)
    if isinstance(values["rope_scaling"], str):
        parsed = _yaml(values["rope_scaling"], "--model.rope-scaling")
        if parsed is not None and not isinstance(parsed, dict):
            raise ValueError(f"--model.rope-scaling must be a mapping or None, got {parsed!r}")
        values["rope_scaling"] = parsed
    return DeepSeekV3Config(**values)


@dataclasses.dataclass(frozen=True)
class TrainCommand:
    """Train a DeepSeek-V3-shaped MoE. Without options: the `tiny` preset on the built-in
    synthetic corpus, on CPU, in about a minute; prints where results went (metrics JSONL,
    plots, checkpoints)."""

    model: ModelOptions  # type: ignore[valid-type]
    """Model architecture (Hugging Face DeepSeek-V3 field names); defaults come from --preset
    and --config."""
    train: Annotated[TrainConfig, tyro.conf.OmitArgPrefixes]
    """Training settings."""
    preset: Literal[_PRESET_NAMES] = "tiny"  # type: ignore[valid-type]
    """Model preset that the model options start from."""
    config: str | None = None
    """YAML file with (some of) the sections `preset`, `backend`, `model`, `train`, such as
    the config.yaml of a run; flags override it."""
    backend: Literal[_BACKEND_NAMES] = "auto"  # type: ignore[valid-type]
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
    compile_cache: bool = True
    """Keep compiled steps in a persistent cache (~/.cache/dropless/jax, or
    $JAX_COMPILATION_CACHE_DIR), so later runs of the same shapes start in seconds."""

    def configs(self) -> tuple[DeepSeekV3Config, TrainConfig]:
        """The model and training configs these options describe (`--set` applied)."""
        return apply_overrides(_from_options(self.model), self.train, self.set)


@dataclasses.dataclass(frozen=True)
class PresetsCommand:
    """List the model presets with their parameter counts."""


def _flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of `--name X` or `--name=X` in args (the last one wins), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _yaml(text, where: str):
    """`text` (a string or an open file) parsed as YAML; a syntax error is a ValueError that
    names `where` and the place in the text."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: not valid YAML ({' '.join(str(err).split())})") from None


def load_yaml_config(path: str) -> dict:
    """A run config file: a mapping with (some of) the sections preset, backend, model, train."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path) as f:
        data = _yaml(f, path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with sections {', '.join(_SECTIONS)}")
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ValueError(
            f"{path}: unknown section(s) {', '.join(unknown)}; known: {', '.join(_SECTIONS)}"
        )
    return data


def _replace_checked(config, values: object, where: str):
    """`config` with `values` (from YAML) replaced: unknown names are errors, and numbers that
    YAML read as strings (PyYAML reads 1e-3 as a string) become numbers, and "None" (YAML's
    null is `null`) becomes None where a field takes None."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: must be a mapping of field: value, got {values!r}")
    types = {f.name: f.type for f in dataclasses.fields(config)}
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(types))}"
        )
    values = dict(values)
    for name, value in values.items():
        kind = types[name]
        if value == "None" and type(None) in typing.get_args(kind):
            values[name] = None
            continue
        convert = (kind is float and isinstance(value, int | str)) or (
            kind is int and isinstance(value, str)
        )
        if convert and not isinstance(value, bool):
            try:
                values[name] = kind(value)
            except ValueError:
                wanted = "an int" if kind is int else "a number"
                raise ValueError(f"{where}: {name} must be {wanted}, got {value!r}") from None
    return dataclasses.replace(config, **values)


def _defaults(args: Sequence[str]) -> TrainCommand:
    """The train command's defaults: preset, then the YAML config, from a first look at args."""
    file = _flag_value(args, "--config")
    data = load_yaml_config(file) if file else {}
    preset = _flag_value(args, "--preset") or data.get("preset", "tiny")
    model = get_preset(preset)
    model = _replace_checked(model, data.get("model") or {}, f"{file}: model")
    train = _replace_checked(TrainConfig(), data.get("train") or {}, f"{file}: train")
    backend = data.get("backend", "auto")
    if backend not in _BACKEND_NAMES:
        raise ValueError(
            f"{file}: unknown backend {backend!r}; known backends: {', '.join(_BACKEND_NAMES)}"
        )
    return TrainCommand(
        model=_to_options(model), train=train, preset=preset, config=file, backend=backend
    )


def apply_overrides(
    model: DeepSeekV3Config, train: TrainConfig, overrides: Sequence[str]
) -> tuple[DeepSeekV3Config, TrainConfig]:
    """Applies `section.field=value` overrides (value parsed as YAML) to the two configs."""
    changes: dict[str, dict] = {"model": {}, "train": {}}
    for item in overrides:
        key, sep, raw = item.partition("=")
        section, dot, field = key.strip().partition(".")
        if not sep or not dot or section not in changes:
            raise ValueError(
                f"--set {item!r}: expected model.<field>=<value> or train.<field>=<value>"
            )
        changes[section][field.replace("-", "_")] = _yaml(raw, f"--set {item!r}")
    model = _replace_checked(model, changes["model"], "--set model")
    train = _replace_checked(train, changes["train"], "--set train")
    return model, train


def parse(args: Sequence[str]) -> TrainCommand | PresetsCommand:
    """The command that `args` (without the program name) describe; tyro exits on --help and
    on malformed options, ValueError/FileNotFoundError report bad presets or config files."""
    if args and args[0] == "train":
        # parsed on its own (not as the subcommand of a union) so that tyro's messages name
        # `dropless train` and its options rather than an internal wrapper
        command = tyro.cli(
            TrainCommand,
            default=_defaults(args[1:]),
            args=list(args[1:]),
            prog="dropless train",
            description=inspect.cleandoc(TrainCommand.__doc__),
        )
    else:
        command = tyro.cli(
            Union[  # noqa: UP007
                Annotated[TrainCommand, tyro.conf.subcommand("train")],
                Annotated[PresetsCommand, tyro.conf.subcommand("presets")],
            ],
            args=list(args),
            prog="dropless",
            description="dropless: dropless Mixture-of-Experts training in JAX.",
        )
    resumed = _resumed_config(command)
    return parse([*args, "--config", resumed]) if resumed else command


def _resumed_config(command: "TrainCommand | PresetsCommand") -> str | None:
    """The config.yaml of the run that `command` resumes, when no `--config` was given: the run
    goes on with its own model and settings (the flags and `--set` still override them)."""
    if not isinstance(command, TrainCommand) or command.config or command.out_dir is None:
        return None
    from dropless.train.loop import CONFIG_FILE

    path = os.path.join(command.out_dir, CONFIG_FILE)
    return path if command.configs()[1].resume and os.path.isfile(path) else None


def _list_presets() -> None:
    from dropless.models.deepseek_v3 import count_params

    def human(n: int) -> str:
        if n == 0:
            return "-"
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    print(f"{'preset':<18} {'total':>8} {'active':>8} {'mtp':>8}")
    for name in PRESETS:
        count = count_params(get_preset(name))
        print(f"{name:<18} {human(count.total):>8} {human(count.active):>8} {human(count.mtp):>8}")


def _describe(results, elapsed: float) -> str:
    files = results.files
    lines = [f"Done in {elapsed:.0f} s. Results in {results.out_dir}:"]
    final = results.final_eval
    if final is not None:
        lines.append(
            f"  eval loss {final['loss']:.4f} (cross-entropy {final['ce']:.4f}, "
            f"MaxVio {final['max_vio']:.3f}) at step {final['step']}"
        )
    lines.append(f"  metrics      {files['metrics']}")
    lines.append(f"  config       {files['config']}")
    lines.append(f"  checkpoints  {files['checkpoints']}")
    for key, label in (("loss_plot", "loss plot"), ("load_plot", "expert load")):
        if key in files:
            lines.append(f"  {label:<12} {files[key]}")
    lines.append(f"  summary      {files['summary']}")
    return "\n".join(lines)


def run_name(command: TrainCommand, resume: bool) -> str:
    """What the header calls the run, and the default output directory starts with: the
    resumed run's directory, the --config file's name (its run's, for a run's own
    config.yaml), or the preset."""
    if resume and command.out_dir:
        return os.path.basename(os.path.normpath(command.out_dir))
    if command.config:
        path = os.path.abspath(command.config)
        name = os.path.splitext(os.path.basename(path))[0]
        return (os.path.basename(os.path.dirname(path)) or name) if name == "config" else name
    return command.preset


def _backend_label(backend: str) -> str:
    """The backend's name, with the one it stands for if it is "auto": "auto (jnp)"."""
    from dropless.backends import resolve_backend_name

    resolved = resolve_backend_name(backend)
    return backend if resolved == backend else f"{backend} ({resolved})"


def _train(command: TrainCommand) -> int:
    from dropless.train.checkpoint import CheckpointError
    from dropless.train.loop import TrainingDiverged, train
    from dropless.train.metrics import EvalLines, ProgressBar

    model, train_config = command.configs()
    if train_config.resume and command.out_dir is None:
        raise ValueError("--resume needs --out-dir (the directory of the run to continue)")
    name = run_name(command, train_config.resume)
    out_dir = command.out_dir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if command.compile_cache:
        from dropless.train.compile_cache import enable_compile_cache

        enable_compile_cache()
    data = "the synthetic corpus" if train_config.data == "synthetic" else train_config.data
    verb = "resuming" if train_config.resume else "training"
    mesh = f", mesh {train_config.mesh}" if train_config.mesh else ""
    print(
        f"dropless: {verb} '{name}' on {data} for {train_config.steps} "
        f"step{'s' if train_config.steps != 1 else ''} "
        f"(batch {train_config.batch_size} x {train_config.seq_len} tokens, backend "
        f"{_backend_label(command.backend)}{mesh}) -> {out_dir}",
        flush=True,
    )
    bar = ProgressBar(file=sys.stderr) if command.progress else None
    began = time.perf_counter()
    try:
        results = train(
            model,
            train_config,
            backend=command.backend,
            out_dir=out_dir,
            callbacks=[bar] if bar else [EvalLines(file=sys.stdout)],
        )
    except (TrainingDiverged, CheckpointError) as err:
        if bar:
            bar.close()
        print(f"dropless: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if bar:
            bar.close()
        print(
            f"dropless: interrupted; continue with: dropless train --out-dir {out_dir} --resume",
            file=sys.stderr,
        )
        return 130
    print(_describe(results, time.perf_counter() - began))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dropless` command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    # CPU training reuses its freed buffers instead of page-faulting them in afresh at every
    # step (the tiny preset's 200 steps: 21-24 s -> 18-21 s); no effect if JAX already runs
    keep_freed_memory(warn=False)
    try:
        command = parse(args)
        if isinstance(command, PresetsCommand):
            _list_presets()
            return 0
        return _train(command)
    except (ValueError, FileNotFoundError, BackendUnavailableError) as err:
        print(f"dropless: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
