"""Running a parsed command: `dropless presets`' table, and `dropless train`'s header, run
and summary of where the results went."""

import os
import signal
import sys
import time

from dropless.backends import get_backend, resolve_backend_name
from dropless.cli.options import TrainCommand
from dropless.models.deepseek_v3 import PRESETS, count_params, get_preset
from dropless.sharding import parse_mesh
from dropless.train.checkpoint import CheckpointError
from dropless.train.compile_cache import enable_compile_cache
from dropless.train.data_source import DataSource, fit_vocab, open_data
from dropless.train.loop import TrainingDiverged, TrainingPreempted, train
from dropless.train.metrics import EvalLines, ProgressBar
from dropless.train.run_lock import RunDirectoryLocked
from dropless.train.sample import eval_prompt, sample

SAMPLE_PROMPT_TOKENS = 24
SAMPLE_NEW_TOKENS = 160
SAMPLE_TEMPERATURE = 0.8


def list_presets() -> None:
    """Prints every model preset with its total, active and MTP parameter counts."""

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
    rate = results.throughput
    if rate["tokens_per_s"] is not None:
        mfu = "n/a (no known peak FLOP/s here)" if rate["mfu"] is None else f"{rate['mfu']:.1%}"
        lines.append(
            f"  throughput   {rate['tokens_per_s']:,.0f} tokens/s, MFU {mfu} "
            "(medians over the steps after the first)"
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


def _backend_label(backend: str, mesh: str | None = None) -> str:
    """The backend's name, with the one it stands for if it is "auto": "auto (jnp)"; on a
    mesh with an expert axis > 1, what dispatches when the backend does not exchange tokens
    itself (`prepare_model` swaps in the "ep" dispatcher, keeping the other stages)."""
    resolved = resolve_backend_name(backend)
    label = backend if resolved == backend else f"{backend} ({resolved})"
    if not mesh or parse_mesh(mesh).get("expert", 1) == 1:
        return label
    try:
        exchanging = get_backend(backend).expert_parallel
    except ImportError:  # `train` says what is missing
        return label
    return label if exchanging else f"{label} with the 'ep' dispatcher"


def _data_label(data: DataSource) -> str:
    record = data.record
    if record["source"] == "synthetic":
        return "the synthetic corpus"
    if record["source"] == "stdlib":
        tokens = record["train_tokens"]
        return f"the Python stdlib corpus ({record['tokenizer']}, {tokens:,} tokens)"
    return record["path"]


def _print_sample(results, data: DataSource) -> None:
    prompt = eval_prompt(data.eval, SAMPLE_PROMPT_TOKENS)
    if prompt is None or data.tokenizer is None:
        return
    out = sample(
        results.model,
        data.tokenizer,
        prompt,
        max_new_tokens=SAMPLE_NEW_TOKENS,
        temperature=SAMPLE_TEMPERATURE,
    )
    print(
        f"Sample (the eval split's first {len(prompt)} tokens in [brackets], then what the "
        f"model writes at temperature {SAMPLE_TEMPERATURE}; --no-sample turns this off):"
    )
    print(f"[{out.prompt}]{out.text}")


def run_train(command: TrainCommand, *, vocab_given: bool = True) -> int:
    """Runs `dropless train`. Unless `vocab_given`, the data's tokenizer sets the model's
    vocabulary size."""
    model, train_config = command.configs()
    if train_config.resume and command.out_dir is None:
        raise ValueError("--resume needs --out-dir (the directory of the run to continue)")
    data = open_data(train_config, model.vocab_size, progress=command.progress)
    model = fit_vocab(model, data, given=vocab_given)
    name = run_name(command, train_config.resume)
    out_dir = command.out_dir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if command.compile_cache:
        enable_compile_cache()
    verb = "resuming" if train_config.resume else "training"
    mesh = f", mesh {train_config.mesh}" if train_config.mesh else ""
    print(
        f"dropless: {verb} '{name}' on {_data_label(data)} for {train_config.steps} "
        f"step{'s' if train_config.steps != 1 else ''} "
        f"(batch {train_config.batch_size} x {train_config.seq_len} tokens, backend "
        f"{_backend_label(command.backend, train_config.mesh)}{mesh}) -> {out_dir}",
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
    except (TrainingDiverged, CheckpointError, RunDirectoryLocked) as err:
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
    except TrainingPreempted as err:
        if bar:
            bar.close()
        print(
            f"dropless: {err}; continue with: dropless train --out-dir {out_dir} --resume",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    print(_describe(results, time.perf_counter() - began), flush=True)
    # a mesh run's model routes through its expert-parallel layers, which decode only inside
    # the mesh's shard_map: no sample there
    if command.sample and not train_config.mesh:
        _print_sample(results, data)
    return 0
