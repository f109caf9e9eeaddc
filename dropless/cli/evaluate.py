"""`dropless eval RUN_DIR`: a trained run's loss, perplexity and bits per byte, printed as a
table and appended to the run's metrics.jsonl (`"split": "eval_cli"`)."""

import dataclasses
import sys
from typing import Annotated, Literal

import tyro

from dropless.files import disk_error, is_disk_error
from dropless.train.loop.run_eval import append_metrics, evaluate_run
from dropless.train.store.run_dir import load_run


@dataclasses.dataclass(frozen=True)
class EvalCommand:
    """Cross-entropy, perplexity and bits per byte of a trained run on held-out text, printed
    and appended to the run's metrics.jsonl."""

    run_dir: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="RUN_DIR")]
    """A run's --out-dir."""
    data: str | None = None
    """A prepared directory whose eval split to read (default: the run's eval data)."""
    step: int | None = None
    """The checkpoint (default: the latest)."""
    batches: int | Literal["all"] | None = None
    """Batches of random windows to score (default: the run's eval_batches), or 'all': every
    token of the eval split, once, in consecutive windows."""
    batch_size: int | None = None
    """Sequences per batch (default: the run's)."""


def format_result(result: dict) -> str:
    """The result of `evaluate_run` as a small table."""
    size = f"{result['batches']} x {result['batch_size']} x {result['seq_len']}"
    n_bytes = "-" if result["bytes"] is None else f"{result['bytes']:,}"
    bpb = result["bits_per_byte"]
    rows = [
        ("cross-entropy", f"{result['ce']:.4f} nats/token"),
        ("perplexity", f"{result['perplexity']:.3f}"),
        ("bits per byte", "- (no tokenizer)" if bpb is None else f"{bpb:.4f}"),
        ("total loss", f"{result['loss']:.4f} (cross-entropy + MTP and balance terms)"),
        ("data", str(result["data"])),
        ("step", str(result["step"])),
        ("tokens", f"{result['tokens']:,} ({size})"),
        ("bytes", n_bytes),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def run(args: EvalCommand) -> int:
    """Evaluates as `args` say, prints the table and appends it to the run's metrics."""
    loaded = load_run(args.run_dir, args.step)
    result = evaluate_run(loaded, data=args.data, batches=args.batches, batch_size=args.batch_size)
    print(format_result(result))
    try:
        append_metrics(loaded.metrics_path, result)
    except OSError as err:
        if not is_disk_error(err):
            raise
        # the numbers above stand; only their record is missing
        print(f"dropless eval: note: not recorded: {disk_error(err, loaded.metrics_path)}",
              file=sys.stderr)  # fmt: skip
        return 0
    print(f"appended to {loaded.metrics_path}")
    return 0
