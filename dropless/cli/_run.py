"""Running a parsed command: `dropless presets`' table, and `dropless train`'s header, run
and summary of where the results went."""

import math
import os
import signal
import sys
import time

import numpy as np

from dropless._files import disk_error, is_disk_error
from dropless.cli._options import TrainCommand
from dropless.models import PRESETS, get_preset
from dropless.models.deepseek_v3 import count_params
from dropless.sharding import parse_mesh
from dropless.train._backend_names import get_backend, resolve_backend_name
from dropless.train.loop import _setup as setup
from dropless.train.loop._callbacks import EvalLines, ProgressBar
from dropless.train.loop._data_source import DataSource, fit_vocab, open_data
from dropless.train.loop._loop import TrainingDiverged, TrainingPreempted, train
from dropless.train.loop._run_eval import count_bytes
from dropless.train.loop._sample import eval_prompt, sample
from dropless.train.store._checkpoint import CheckpointError
from dropless.train.store._compile_cache import enable_compile_cache
from dropless.train.store._layout import CHECKPOINT_DIR
from dropless.train.store._lock import RunDirectoryLocked

SAMPLE_PROMPT_TOKENS = 24
SAMPLE_NEW_TOKENS = 160
SAMPLE_TEMPERATURE = 0.8


def list_presets() -> None:
    """Prints every model preset's family (Hugging Face model type), parameter counts (total,
    active per token, MTP) and shape: layers (dense first), routed experts (+ shared) and top-k,
    the model, dense and expert widths."""

    def human(n: int) -> str:
        if n == 0:
            return "-"
        if n >= 1e12:
            return f"{n / 1e12:.2f}T"
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    header = (
        "preset",
        "family",
        "total",
        "active",
        "mtp",
        "layers",
        "experts",
        "top-k",
        "width",
        "ffn",
    )
    rows = [header]
    for name in PRESETS:
        c = get_preset(name)
        count = count_params(c)
        rows.append(
            (
                name,
                c.model_type,
                human(count.total),
                human(count.active),
                human(count.mtp),
                f"{c.num_hidden_layers} ({c.first_k_dense_replace} dense)",
                f"{c.n_routed_experts}+{c.n_shared_experts}",
                str(c.num_experts_per_tok),
                str(c.hidden_size),
                f"{c.intermediate_size}/{c.moe_intermediate_size}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [
            row[0].ljust(widths[0]),
            row[1].ljust(widths[1]),
            *(v.rjust(w) for v, w in zip(row[2:], widths[2:], strict=True)),
        ]
        print("  ".join(cells))
    print("experts: routed+shared per MoE layer; width: hidden size; ffn: dense/expert widths")


def _describe(results, elapsed: float, bits_per_byte: float | None = None) -> str:
    files = results.files
    lines = [f"Done in {elapsed:.0f} s. Results in {results.out_dir}:"]
    final = results.final_eval
    if final is not None:
        bpb = "" if bits_per_byte is None else f", bits per byte {bits_per_byte:.4f}"
        lines.append(
            f"  eval (step {final['step']})  cross-entropy {final['ce']:.4f}, perplexity "
            f"{math.exp(final['ce']):.2f}{bpb}"
        )
        lines.append(
            f"               total loss {final['loss']:.4f} (with the MTP and balance terms), "
            f"MaxVio {final['max_vio']:.3f}"
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
    lines.append(
        f"Next: dropless eval {results.out_dir}, dropless generate {results.out_dir} --prompt "
        "TEXT, or load_run in Python (docs/use-a-trained-model.md)."
    )
    return "\n".join(lines)


def final_bits_per_byte(results, data: DataSource, train_config) -> float | None:
    """Bits per byte of the run's last evaluation: its cross-entropy over the UTF-8 bytes of
    the very targets it scored (None without a tokenizer or an evaluation)."""
    final = results.final_eval
    if final is None or data.tokenizer is None:
        return None
    targets = np.concatenate(
        [
            setup.batch(data.eval, i, train_config, "eval").tokens[:, 1:]
            for i in range(train_config.eval_batches)
        ]
    )
    n_bytes = count_bytes(data.tokenizer, targets)
    return final["ce"] * targets.size / math.log(2) / n_bytes if n_bytes else None


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


def disk_line(err: OSError, out_dir: str) -> str:
    """One line for a write that a full or read-only disk refused (`dropless._files`)."""
    if (
        err.filename is None
        and err.strerror
        and str(err.strerror).startswith(("no space", "cannot write"))
    ):
        return err.strerror  # already the line (`MetricsWriter.write`)
    return disk_error(err, err.filename or out_dir)


def what_is_saved(out_dir: str) -> str:
    """A true statement of what an interrupted run left in `out_dir`, and what to run next."""
    directory = os.path.join(out_dir, CHECKPOINT_DIR)
    steps = sorted(
        int(name)
        for name in (os.listdir(directory) if os.path.isdir(directory) else [])
        if name.isdigit()
    )
    if not steps:
        return "no checkpoint was saved, so there is nothing to resume: start the run again"
    return (
        f"the newest checkpoint is step {steps[-1]}; continue with: dropless train --out-dir "
        f"{out_dir} --resume"
    )


# Over 60 lines: the header, the call and one handler per way a run ends (each closes the bar,
# prints one line and returns its exit code), read in the order they happen.
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
            data=data,
        )
    except (TrainingDiverged, CheckpointError, RunDirectoryLocked) as err:
        if bar:
            bar.close()
        print(f"dropless: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        if not is_disk_error(err):
            raise
        if bar:
            bar.close()
        print(f"dropless: error: {disk_line(err, out_dir)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if bar:
            bar.close()
        print(f"dropless: interrupted; {what_is_saved(out_dir)}", file=sys.stderr)
        return 128 + signal.SIGINT
    except TrainingPreempted as err:
        if bar:
            bar.close()
        print(
            f"dropless: {err}; continue with: dropless train --out-dir {out_dir} --resume",
            file=sys.stderr,
        )
        return 128 + getattr(signal, err.signal_name, signal.SIGTERM)
    elapsed = time.perf_counter() - began
    bits_per_byte = final_bits_per_byte(results, data, train_config)
    print(_describe(results, elapsed, bits_per_byte), flush=True)
    # a mesh run's model routes through its expert-parallel layers, which decode only inside
    # the mesh's shard_map: no sample there
    if command.sample and not train_config.mesh:
        _print_sample(results, data)
    return 0
