"""The subcommands of `dropless` besides `train` (presets, prepare, plan, eval, generate), the
command's own `--help`, and the one-line errors every subcommand reports.

Each subcommand is an options dataclass whose field docstrings are its help, parsed by
`dropless.cli._parsing.parse_command` as `train` is."""

import sys
from collections.abc import Callable, Sequence

from dropless.backends import BackendUnavailableError
from dropless.cli import _evaluate as evaluate
from dropless.cli import _generate as generate
from dropless.cli import _plan as plan
from dropless.cli import _verify as verify
from dropless.cli._options import PresetsCommand
from dropless.cli._parsing import parse_command
from dropless.cli._run import list_presets
from dropless.data import _cli as prepare
from dropless.train.store._checkpoint import CheckpointError

TRAIN = ("train", "train a model (--help: common options; --help-all: all of them)")


def _presets(_: PresetsCommand) -> int:
    list_presets()
    return 0


# name -> (one-line description, options dataclass, run the parsed options)
COMMANDS: dict[str, tuple[str, type, Callable[..., int]]] = {
    "presets": ("the model presets: sizes and shapes", PresetsCommand, _presets),
    "prepare": (
        "tokenize text files into a data directory for train --data",
        prepare.PrepareCommand,
        prepare.run,
    ),
    "plan": (
        "per-device memory, FLOPs and all-to-all traffic of a training step",
        plan.PlanCommand,
        plan.run,
    ),
    "eval": (
        "cross-entropy, perplexity and bits per byte of a trained run",
        evaluate.EvalCommand,
        evaluate.run,
    ),
    "generate": (
        "text from a trained run, or from a Hugging Face checkpoint",
        generate.GenerateCommand,
        generate.run,
    ),
    "verify": (
        "a run's config, checkpoint digests and data identity, checked",
        verify.VerifyCommand,
        verify.run,
    ),
}
_ERRORS = (ValueError, OSError, CheckpointError, BackendUnavailableError)


def top_help() -> str:
    """`dropless --help`: the subcommands, one line each."""
    rows = dict([TRAIN, *((name, c[0]) for name, c in COMMANDS.items())])
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


def run_command(args: Sequence[str]) -> int:
    """Runs `dropless ARGS` for every first word but train: a COMMANDS entry, the help, or a
    one-line error for anything else. Returns the exit status."""
    if not args or args[0] in ("-h", "--help", "help"):
        print(top_help())
        raise SystemExit(0)
    name = args[0]
    if name not in COMMANDS:
        known = [TRAIN[0], *COMMANDS]
        what = "option" if name.startswith("-") else "command"
        near = [n for n in known if n.startswith(name[:3])] if len(name) > 2 else []
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        print(
            f"dropless: error: unknown {what} {name!r}{hint}; the first word is a command: "
            f"{', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    _, options, run = COMMANDS[name]
    parsed = parse_command(options, args[1:], prog=f"dropless {name}")
    try:
        return run(parsed)
    except _ERRORS as err:
        print(f"dropless {name}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
