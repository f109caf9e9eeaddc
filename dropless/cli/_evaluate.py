"""`dropless eval RUN_DIR`: a trained run's loss, perplexity and bits per byte, printed as a
table and appended to the run's metrics.jsonl (`"split": "eval_cli"`). `--record-routing FILE`
also records the expert choice of the windows it scored; `--replay-routing FILE` scores the
sequences of such a file (or of `dropless generate --record-routing`) with the routing recorded
there instead (`"split": "eval_replay"`; `dropless.train.loop._routing_eval`)."""

import dataclasses
import os
import sys
from typing import Annotated, Literal

import tyro

from dropless._files import disk_error, is_disk_error
from dropless.models.deepseek_v3._routing_file import save_routing
from dropless.train.loop._routing_eval import REPLAY_SPLIT, evaluate_replay, record_routing
from dropless.train.loop._run_eval import (
    append_metrics,
    evaluate_run,
    scored_windows,
)
from dropless.train.store._run_dir import load_run


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
    record_routing: str | None = None
    """Also write the expert choice of every scored window to this .npz file (routing
    replay: `--replay-routing` it later)."""
    replay_routing: str | None = None
    """Score the sequences of this routing file (from `--record-routing` here or in `dropless
    generate`) with the routing recorded there, beside the model's own routing."""


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


def format_replay(result: dict) -> str:
    """The result of `evaluate_replay` as a small table."""
    bpb = result["bits_per_byte"]
    rows = [
        ("cross-entropy", f"{result['ce']:.4f} nats/token (recorded routing)"),
        ("own routing", f"{result['ce_own_routing']:.4f} nats/token (the model's top-k)"),
        ("agreement", f"{result['routing_agreement']:.4f} of the recorded choices"),
        ("perplexity", f"{result['perplexity']:.3f}"),
        ("bits per byte", "- (no tokenizer)" if bpb is None else f"{bpb:.4f}"),
        ("routing", str(result["routing"])),
        ("step", str(result["step"])),
        ("tokens", f"{result['tokens']:,} ({result['sequences']} sequences)"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def run(args: EvalCommand) -> int:
    """Evaluates as `args` say, prints the table and appends it to the run's metrics."""
    if args.replay_routing is not None and (
        args.data is not None or args.batches is not None or args.record_routing is not None
    ):
        raise ValueError(
            "--replay-routing scores the sequences of its file: it takes no --data, --batches "
            "or --record-routing"
        )
    loaded = load_run(args.run_dir, args.step)
    if args.replay_routing is not None:
        result = evaluate_replay(loaded, args.replay_routing, batch_size=args.batch_size)
        print(format_replay(result))
        path = loaded.metrics_path
        return _record(path, lambda: append_metrics(path, result, REPLAY_SPLIT))
    result = evaluate_run(loaded, data=args.data, batches=args.batches, batch_size=args.batch_size)
    print(format_result(result))
    if args.record_routing is not None:
        windows = scored_windows(
            loaded, data=args.data, batches=args.batches, batch_size=args.batch_size
        )
        tokens, replay = record_routing(loaded.model, windows)
        save_routing(args.record_routing, tokens, replay)
        print(f"routing of {tokens.shape[0]} windows recorded in {args.record_routing}")
    return _record(loaded.metrics_path, lambda: append_metrics(loaded.metrics_path, result))


def _record(metrics_path: str | os.PathLike, append) -> int:
    """Runs `append` (the metrics line's write); a full or read-only disk is a note."""
    try:
        append()
    except OSError as err:
        if not is_disk_error(err):
            raise
        # the numbers above stand; only their record is missing
        print(f"dropless eval: note: not recorded: {disk_error(err, metrics_path)}",
              file=sys.stderr)  # fmt: skip
        return 0
    print(f"appended to {metrics_path}")
    return 0
