"""`dropless prepare INPUT... --out DIR`: the command-line front end of `prepare`.

`main(argv)` returns the exit status: 0, or 2 with a one-line message for bad input (a missing,
empty or unreadable input, an existing output directory), never a traceback.
"""

import dataclasses
import sys
from typing import Annotated

import tyro

from dropless.data._prepare import prepare
from dropless.data._sources import FOLDER_EXTENSIONS


@dataclasses.dataclass(frozen=True)
class PrepareCommand:
    """Tokenize text into OUT/train.bin, eval.bin, tokenizer.json and meta.json, the data
    directory that `dropless train --data OUT` reads."""

    inputs: Annotated[tyro.conf.Positional[tuple[str, ...]], tyro.conf.arg(metavar="INPUT")]
    """Text files, folders (recursively, by --extensions), .jsonl (a 'text' field per line) or
    .parquet (a 'text' column; needs pyarrow)."""
    out: str
    """The output directory."""
    tokenizer: str = "byte"
    """'byte' (256 byte symbols + bos/eos), 'bpe' (byte-level BPE trained on the train split) or
    the path of a tokenizer.json."""
    vocab_size: int | None = None
    """BPE vocabulary size (None: 8192)."""
    eval_fraction: float = 0.02
    """Expected fraction of documents held out for eval."""
    seed: int = 0
    """Seed of the train/eval split."""
    extensions: str = " ".join(FOLDER_EXTENSIONS)
    """File extensions read from folders, space- or comma-separated."""
    overwrite: bool = False
    """Replace an existing output directory."""
    progress: bool = True
    """Show a progress bar."""


def run(args: PrepareCommand) -> int:
    """Prepare as `args` say and print a summary; the exit status."""
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
            progress=args.progress,
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
    """`python -m dropless.data ARGS`, the same options as `dropless prepare` (whose help and
    errors dropless.cli writes); the exit status."""
    return run(tyro.cli(PrepareCommand, args=argv, prog="python -m dropless.data"))
