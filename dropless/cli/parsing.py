"""From arguments to a command: defaults from the preset and `--config`, then tyro's parse of
the flags, `--help` and `--help-all` (dropless.cli.help), and a resumed run's own config."""

import contextlib
import inspect
import io
import os
import re
import sys
from collections.abc import Sequence
from typing import Annotated, Union

import tyro

from dropless.cli.config_file import load_yaml_config, replace_checked
from dropless.cli.help import HELP_FLAGS, full_help, short_help
from dropless.cli.options import (
    PresetsCommand,
    TrainCommand,
    backend_names,
    to_options,
)
from dropless.models import get_preset
from dropless.train.config import TrainConfig
from dropless.train.store.layout import CHECKPOINT_DIR, CONFIG_FILE
from dropless.train.store.resume import saved_run_config


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of `--name X` or `--name=X` in args (the last one wins), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def defaults(args: Sequence[str], saved: dict | None = None) -> TrainCommand:
    """The train command's defaults: preset, then the YAML config, from a first look at args
    (`saved`: a resumed run's config read from its checkpoint, in place of the file)."""
    file = flag_value(args, "--config")
    data = saved if saved is not None else load_yaml_config(file) if file else {}
    preset = flag_value(args, "--preset") or data.get("preset", "tiny")
    model = get_preset(preset)
    model = replace_checked(model, data.get("model") or {}, f"{file}: model")
    train = replace_checked(TrainConfig(), data.get("train") or {}, f"{file}: train")
    backend = data.get("backend", "auto")
    if backend not in backend_names():
        raise ValueError(f"{file}: {_unknown_backend(backend)}")
    return TrainCommand(
        model=to_options(model), train=train, preset=preset, config=file, backend=backend
    )


def _unknown_backend(name: str) -> str:
    known = ", ".join(repr(n) for n in backend_names())
    return f"unknown backend {name!r}; known backends: {known}"


def _print_help(args: Sequence[str]) -> None:
    """Prints the train command's help (all of it with --help-all) and exits."""
    base = defaults(args)
    print(full_help(base) if "--help-all" in args else short_help(base))
    raise SystemExit(0)


def parse(args: Sequence[str], _saved: dict | None = None) -> TrainCommand | PresetsCommand:
    """The command that `args` (without the program name) describe; exits on --help and, through
    tyro, on malformed options; ValueError/FileNotFoundError report bad presets or config
    files."""
    if args and args[0] == "train":
        if any(arg in HELP_FLAGS for arg in args[1:]):
            _print_help(args[1:])
        # parsed on its own (not as the subcommand of a union) so that tyro's messages name
        # `dropless train` and its options rather than an internal wrapper
        command = _tyro_cli(
            TrainCommand,
            default=defaults(args[1:], _saved),
            args=list(args[1:]),
            prog="dropless train",
            description=inspect.cleandoc(TrainCommand.__doc__),
        )
    else:
        command = _tyro_cli(
            Union[  # noqa: UP007
                Annotated[TrainCommand, tyro.conf.subcommand("train")],
                Annotated[PresetsCommand, tyro.conf.subcommand("presets")],
            ],
            args=list(args),
            prog="dropless",
            description="dropless: dropless Mixture-of-Experts training in JAX.",
        )
    if isinstance(command, TrainCommand) and command.backend not in backend_names():
        print(
            f"dropless: error: --backend: {_unknown_backend(command.backend)} "
            "(see dropless train --help)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if _saved is not None:
        return command
    resumed = _resumed_config(command)
    if isinstance(resumed, str):
        return parse([*args, "--config", resumed])
    return parse(args, resumed) if resumed is not None else command


def vocab_given(command: TrainCommand, args: Sequence[str]) -> bool:
    """Whether the user gave the model's vocabulary size (`--model.vocab-size`, `--set
    model.vocab_size=`, or a `--config` file's model section, a resumed run's included); if
    not, the data's tokenizer sets it."""
    flags = ("--model.vocab-size", "--model.vocab_size")
    sets = ("model.vocab_size=", "model.vocab-size=")
    if any(a.split("=", 1)[0] in flags for a in args) or any(
        s.strip().startswith(sets) for s in command.set
    ):
        return True
    return bool(command.config) and "vocab_size" in (
        load_yaml_config(command.config).get("model") or {}
    )


_FRAME = "│╭╮╰╯─ "


def one_line_error(text: str) -> str:
    """tyro's boxed error message as one line: the paragraph under the box's title, without
    the frame (drawn in box characters on a terminal, in dashes elsewhere)."""
    paragraphs: list[list[str]] = [[]]
    for raw in text.splitlines():
        line = raw.strip().strip(_FRAME)
        if line and set(line) <= set("─-"):
            paragraphs.append([])
        elif line:
            paragraphs[-1].append(line)
    lines = [line for paragraph in paragraphs for line in paragraph]
    if not lines:
        return " ".join(text.split())
    body = [p for p in paragraphs if p]
    first = body[0][1:] or (body[1] if len(body) > 1 else body[0])  # past the title
    message = " ".join(first)
    m = re.match(r"Error parsing (\S+): (.*)", message)
    if m:
        message = f"{m[1]}: {m[2]}" if m[1].startswith("-") else m[2]
    return message


def _tyro_cli(kind, **kwargs):
    """`tyro.cli`, its error box turned into the one-line `dropless: error: ...` of every
    other message (exit status 2); its help text and other output are passed through."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return tyro.cli(kind, **kwargs)
    except SystemExit as exit_:
        if exit_.code in (0, None):
            print(out.getvalue(), end="")
            raise
        prog = kwargs.get("prog", "dropless")
        print(
            f"dropless: error: {one_line_error(out.getvalue())} (see {prog} --help)",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def _resumed_config(command: TrainCommand | PresetsCommand) -> str | dict | None:
    """The config.yaml of the run that `command` resumes, when no `--config` was given, else
    (the file gone) the config saved with its newest checkpoint: the run goes on with its own
    model and settings (the flags and `--set` still override them)."""
    if not isinstance(command, TrainCommand) or command.config or command.out_dir is None:
        return None
    if not command.configs()[1].resume:
        return None
    path = os.path.join(command.out_dir, CONFIG_FILE)
    if os.path.isfile(path):
        return path
    return saved_run_config(os.path.join(command.out_dir, CHECKPOINT_DIR))
