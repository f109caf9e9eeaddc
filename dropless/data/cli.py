"""`dropless prepare INPUT... --out DIR`: the command-line front end of `prepare`.

`main(argv)` returns the exit status: 0, or 2 with a one-line message for bad input (a missing,
empty or unreadable input, an existing output directory), never a traceback.
"""

import argparse
import sys

from dropless.data.prepare import prepare
from dropless.data.sources import FOLDER_EXTENSIONS


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of `prepare`, added to `parser` (a new one if None)."""
    parser = parser or argparse.ArgumentParser(
        prog="dropless prepare",
        description="Tokenize text into DIR/train.bin, eval.bin, tokenizer.json and meta.json.",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files, folders (recursively, by --extensions), .jsonl (a 'text' field per "
        "line) or .parquet (a 'text' column; needs pyarrow)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the output directory")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|bpe|PATH",
        help="'byte' (256 byte symbols + bos/eos), 'bpe' (byte-level BPE trained on the train "
        "split) or the path of a tokenizer.json (default: byte)",
    )
    parser.add_argument(
        "--vocab-size", type=int, metavar="N", help="BPE vocabulary size (default 8192)"
    )
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=0.02,
        metavar="F",
        help="expected fraction of documents held out for eval (default 0.02)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/eval split")
    parser.add_argument(
        "--extensions",
        default=" ".join(FOLDER_EXTENSIONS),
        metavar="'.EXT ...'",
        help="file extensions read from folders (default: %(default)s)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    """Prepare as `args` (from `build_parser`) say and print a summary; the exit status."""
    try:
        meta = prepare(
            args.inputs,
            args.out,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            eval_fraction=args.eval_fraction,
            seed=args.seed,
            extensions=args.extensions.replace(",", " ").split(),
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (ValueError, OSError) as e:  # FileNotFoundError, FileExistsError are OSErrors
        print(f"dropless prepare: error: {e}", file=sys.stderr)
        return 2
    print(summary(meta, args.out))
    return 0


def summary(meta: dict, out: str) -> str:
    tok = meta["tokenizer"]
    lines = [f"prepared {out}: {tok['kind']} tokenizer, vocab {tok['vocab_size']}, {meta['dtype']}"]
    for split in ("train", "eval"):
        c = meta[split]
        per_byte = c["tokens"] / c["bytes"] if c["bytes"] else float("nan")
        lines.append(
            f"  {split:5s} {c['documents']:>9,} documents {c['bytes']:>14,} bytes "
            f"{c['tokens']:>14,} tokens ({per_byte:.3f} tokens/byte)"
        )
    if meta["eval"]["documents"] == 0:
        lines.append("  warning: one document only, so no eval split; give more text")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
