"""`dropless eval RUN_DIR`: a trained run's loss, perplexity and bits per byte, printed as a
table and appended to the run's metrics.jsonl (`"split": "eval_cli"`)."""

import argparse
import sys

from dropless.files import disk_error, is_disk_error
from dropless.train.loop.run_eval import append_metrics, evaluate_run
from dropless.train.store.run_dir import load_run


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `eval`, added to `parser`."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's --out-dir")
    parser.add_argument(
        "--data",
        metavar="DIR",
        help="a prepared directory whose eval split to read (default: the run's eval data)",
    )
    parser.add_argument("--step", type=int, metavar="N", help="checkpoint (default: the latest)")
    parser.add_argument(
        "--batches", type=int, metavar="N", help="batches (default: the run's eval_batches)"
    )
    parser.add_argument(
        "--batch-size", type=int, metavar="B", help="sequences per batch (default: the run's)"
    )
    return parser


def format_result(result: dict) -> str:
    """The result of `evaluate_run` as a small table."""
    size = f"{result['batches']} x {result['batch_size']} x {result['seq_len']}"
    n_bytes = "-" if result["bytes"] is None else f"{result['bytes']:,}"
    bpb = result["bits_per_byte"]
    rows = [
        ("data", str(result["data"])),
        ("step", str(result["step"])),
        ("tokens", f"{result['tokens']:,} ({size})"),
        ("bytes", n_bytes),
        ("loss (cross-entropy)", f"{result['ce']:.4f}"),
        ("perplexity", f"{result['perplexity']:.3f}"),
        ("bits per byte", "- (no tokenizer)" if bpb is None else f"{bpb:.4f}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def run(args: argparse.Namespace) -> int:
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
