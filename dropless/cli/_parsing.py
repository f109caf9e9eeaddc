"""From arguments to a command, the same way for every command (`parse_command`): `--help`
written from the options dataclass's field docs (dropless.cli._help), an unknown option
answered with the nearest known ones, tyro's parse of the rest with its errors on one line.
`parse` adds what `dropless train` needs first: defaults from the preset and `--config`, and a
resumed run's own config."""

import contextlib
import difflib
import inspect
import io
import os
import re
import sys
from collections.abc import Sequence

import tyro

from dropless.cli._config_file import load_yaml_config, replace_checked
from dropless.cli._help import (
    HELP_FLAGS,
    command_help,
    command_options,
    flag_names,
    full_help,
    options,
    short_help,
)
from dropless.cli._options import PresetsCommand, TrainCommand, to_options
from dropless.models import get_preset
from dropless.train._backend_names import backend_choices
from dropless.train._config import TrainConfig
from dropless.train.store._layout import CHECKPOINT_DIR, CONFIG_FILE
from dropless.train.store._resume import saved_run_config


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
    if backend not in backend_choices():
        raise ValueError(f"{file}: {_unknown_backend(backend)}")
    return TrainCommand(
        model=to_options(model), train=train, preset=preset, config=file, backend=backend
    )


def _unknown_backend(name: str) -> str:
    known = ", ".join(repr(n) for n in backend_choices())
    return f"unknown backend {name!r}; known backends: {known}"


def parse_command(
    cls: type,
    args: Sequence[str],
    *,
    prog: str,
    default: object | None = None,
    help_text: str | None = None,
    known: Sequence[str] | None = None,
    label: str | None = None,
):
    """`args` (after the command's name) parsed into the options dataclass `cls` (`default`:
    an instance with the defaults). `--help` prints `help_text` (default: `command_help`) and
    exits 0; an option not in `known` (default: `cls`'s flags) or anything tyro rejects is one
    line, `LABEL: error: ...` (`label` defaults to `prog`), and exit status 2."""
    label = label or prog
    if any(arg in HELP_FLAGS for arg in args):
        print(help_text or command_help(cls, prog, default))
        raise SystemExit(0)
    known = flag_names(command_options(cls, default)) if known is None else known
    _check_flags(args, known, prog, label)
    return _tyro_cli(
        cls,
        default=default,
        args=list(args),
        prog=prog,
        description=inspect.cleandoc(cls.__doc__ or ""),
        label=label,
    )


def _check_flags(args: Sequence[str], known: Sequence[str], prog: str, label: str) -> None:
    """One line naming the first unknown `--option` in args, with the known flags nearest to
    it ("did you mean --steps?")."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if not name.startswith("--") or name.replace("_", "-") in known:  # tyro takes both
            continue
        near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        _fail(label, f"unknown option {name}{hint}", prog)


def _fail(label: str, message: str, prog: str):
    print(f"{label}: error: {message} (see {prog} --help)", file=sys.stderr)
    raise SystemExit(2)


def parse(args: Sequence[str], _saved: dict | None = None) -> TrainCommand | PresetsCommand:
    """The command that `args` (without the program name) describe; exits on --help and, through
    tyro, on malformed options; ValueError/FileNotFoundError report bad presets or config
    files."""
    if args[:1] == ["presets"]:
        return parse_command(PresetsCommand, args[1:], prog="dropless presets")
    if args[:1] != ["train"]:
        raise ValueError(f"parse reads `train ...` or `presets`, got {' '.join(args)!r}")
    base = defaults(args[1:], _saved)
    help_text = None
    if any(arg in HELP_FLAGS for arg in args[1:]):
        help_text = full_help(base) if "--help-all" in args else short_help(base)
    command = parse_command(
        TrainCommand,
        args[1:],
        prog="dropless train",
        default=base,
        help_text=help_text,
        known=flag_names(options(base)),
        label="dropless",
    )
    if command.backend not in backend_choices():
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


def _tyro_cli(kind, *, label: str, **kwargs):
    """`tyro.cli`, its error box turned into the one-line `LABEL: error: ...` of every other
    message (exit status 2); its other output is passed through."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return tyro.cli(kind, **kwargs)
    except SystemExit as exit_:
        if exit_.code in (0, None):
            print(out.getvalue(), end="")
            raise
        _fail(label, one_line_error(out.getvalue()), kwargs["prog"])


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
