"""The subcommands of `dropless` that argparse parses (prepare, plan, eval, generate), the
command's own `--help`, and the one-line errors every subcommand reports.

`train` and `presets` are parsed by tyro (dropless.cli.parsing); everything else starts here."""

import argparse
import sys
from collections.abc import Callable, Sequence

from dropless.backends import BackendUnavailableError
from dropless.cli import evaluate, generate, plan, verify
from dropless.data import cli as prepare
from dropless.train.store.checkpoint import CheckpointError

# name -> (one-line description, add the options to a parser, run the parsed options)
Command = tuple[str, Callable[[argparse.ArgumentParser], object], Callable[..., int]]
COMMANDS: dict[str, Command] = {
    "prepare": (
        "tokenize text files into a data directory for train --data",
        prepare.build_parser,
        prepare.run,
    ),
    "plan": (
        "per-device memory, FLOPs and all-to-all traffic of a training step",
        plan.build_parser,
        plan.run,
    ),
    "eval": (
        "loss, perplexity and bits per byte of a trained run",
        evaluate.build_parser,
        evaluate.run,
    ),
    "generate": (
        "text from a trained run, or from a Hugging Face checkpoint",
        generate.build_parser,
        generate.run,
    ),
    "verify": (
        "a run's config, checkpoint digests and data identity, checked",
        verify.build_parser,
        verify.run,
    ),
}
TYRO_COMMANDS = {
    "train": "train a model (--help: common options; --help-all: all of them)",
    "presets": "the model presets and their sizes",
}
_ERRORS = (ValueError, OSError, CheckpointError, BackendUnavailableError)


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, `dropless NAME: error: ...`, exit 2."""

    def error(self, message: str):
        hint = f" (see {self.prog} --help)" if "argument" in message else ""
        print(f"{self.prog}: error: {message}{hint}", file=sys.stderr)
        raise SystemExit(2)


def top_help() -> str:
    """`dropless --help`: the subcommands, one line each."""
    rows = {**TYRO_COMMANDS, **{name: c[0] for name, c in COMMANDS.items()}}
    width = max(map(len, rows)) + 3
    lines = [
        "usage: dropless COMMAND [OPTIONS]",
        "",
        "dropless: dropless Mixture-of-Experts training in JAX.",
        "",
        "commands:",
        *(f"  {name:<{width}}{text}" for name, text in rows.items()),
        "",
        "`dropless COMMAND --help` explains a command's options.",
    ]
    return "\n".join(lines)


def parser(name: str) -> OneLineParser:
    """The parser of subcommand `name` (one of COMMANDS)."""
    description, build, _ = COMMANDS[name]
    out = OneLineParser(
        prog=f"dropless {name}", description=description[0].upper() + description[1:] + "."
    )
    build(out)
    return out


def run_command(args: Sequence[str]) -> int:
    """Runs `dropless ARGS` for every first word but train and presets: a COMMANDS entry, the
    help, or a one-line error for anything else. Returns the exit status."""
    if not args or args[0] in ("-h", "--help", "help"):
        print(top_help())
        raise SystemExit(0)
    name = args[0]
    if name not in COMMANDS:
        known = ", ".join([*TYRO_COMMANDS, *COMMANDS])
        what = "option" if name.startswith("-") else "command"
        print(
            f"dropless: error: unknown {what} {name!r}; the first word is a command: {known}",
            file=sys.stderr,
        )
        return 2
    options = parser(name).parse_args(list(args[1:]))
    try:
        return COMMANDS[name][2](options)
    except _ERRORS as err:
        print(f"dropless {name}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
