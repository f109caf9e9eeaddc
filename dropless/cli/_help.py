"""The help of every `dropless` command, written here from its options dataclass's field
docstrings rather than by tyro: each help text reflowed to the terminal (no sentence broken
mid-line, no boxes). `dropless train --help` shows the common options on a screen, `--help-all`
every option in groups. Tyro still parses the options (dropless.cli._parsing)."""

import ast
import dataclasses
import inspect
import re
import shutil
import textwrap
import types
import typing
from typing import Annotated, Literal

import tyro

from dropless.cli._options import MODEL_HELP, ModelOptions, TrainCommand
from dropless.train._backend_names import backend_choices
from dropless.train._config import TrainConfig

HELP_FLAGS = ("-h", "--help", "--help-all")

# `--help` shows these, in this order; `--help-all` shows every option.
COMMON = (
    "preset",
    "steps",
    "batch_size",
    "seq_len",
    "lr",
    "out_dir",
    "resume",
    "data",
    "backend",
    "mesh",
    "config",
    "set",
)

_FLAG_WIDTH = 24  # help text starts in this column
MODEL_GROUP = "model architecture"


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option: its flags, value, help text, default and group."""

    name: str  # the field: "steps", "model.hidden_size", "preset"
    flags: str  # "--steps INT", "--resume, --no-resume"
    doc: str
    default: object
    group: str


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings under a dataclass's fields (what tyro shows as each option's help)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for field, doc in zip(body, body[1:], strict=False):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def _field_groups(cls: type) -> dict[str, str]:
    """Field -> the `# --- group ---` comment above it in the class's source."""
    groups, group = {}, "other"
    for line in inspect.getsource(cls).splitlines():
        heading = re.match(r"\s*# --- (.+?)(?::.*)? ---", line)
        field = re.match(r"\s+(\w+): ", line)
        if heading:
            group = heading.group(1)
        elif field:
            groups[field.group(1)] = group
    return groups


def _metavar(kind) -> str:
    if typing.get_origin(kind) is Annotated:
        kind = typing.get_args(kind)[0]
    args = typing.get_args(kind)
    if typing.get_origin(kind) is Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return "|".join(_metavar(a) for a in args)
    if typing.get_origin(kind) is tuple:
        return f"{_metavar(args[0])} [{_metavar(args[0])} ...]"
    return {type(None): "None"}.get(kind, getattr(kind, "__name__", str(kind)).upper())


_POSITIONAL = typing.get_args(tyro.conf.Positional[int])[1]


def is_positional(kind) -> bool:
    """Whether a field's type is `tyro.conf.Positional[...]` (an argument, not an option)."""
    return typing.get_origin(kind) is Annotated and any(
        marker is _POSITIONAL for marker in kind.__metadata__
    )


def _flags(name: str, kind) -> str:
    if is_positional(kind):
        metavars = [m.metavar for m in kind.__metadata__ if getattr(m, "metavar", None)]
        many = typing.get_origin(typing.get_args(kind)[0]) is tuple
        return (metavars[0] if metavars else name.upper()) + (" ..." if many else "")
    flag = "--" + name.replace("_", "-")
    if kind is bool:
        prefix, _, last = flag.removeprefix("--").rpartition(".")
        return f"{flag}, --{prefix + '.' if prefix else ''}no-{last}"
    return f"{flag} {_metavar(kind)}"


def options(defaults: TrainCommand) -> list[Option]:
    """Every option of `dropless train`, with the defaults of `defaults`, in help order."""
    out = []
    command_docs = attribute_docs(TrainCommand)
    for field in dataclasses.fields(TrainCommand):
        if field.name not in ("model", "train"):
            value = getattr(defaults, field.name)
            flags = _flags(field.name, field.type)
            if field.name == "backend":  # the names registered now
                flags = f"--backend {{{','.join(backend_choices())}}}"
            out.append(Option(field.name, flags, command_docs[field.name], value, "run"))
    train_docs, groups = attribute_docs(TrainConfig), _field_groups(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        value = getattr(defaults.train, field.name)
        flags = _flags(field.name, field.type)
        out.append(Option(field.name, flags, train_docs[field.name], value, groups[field.name]))
    for field in dataclasses.fields(ModelOptions):
        name = f"model.{field.name}"
        kind = typing.get_args(field.type)[0]
        value = getattr(defaults.model, field.name)
        out.append(Option(name, _flags(name, kind), MODEL_HELP[field.name], value, MODEL_GROUP))
    return out


def _width() -> int:
    return max(60, min(100, shutil.get_terminal_size((80, 24)).columns))


def _wrap(text: str, width: int, **kwargs) -> list[str]:
    # at spaces only: never inside a word, a path or a flag
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False, **kwargs)


def _format(option: Option, width: int, *, default: bool = True) -> list[str]:
    # an option whose help names its default already, or `--set` (none), shows no default
    no_default = not default or option.name == "set" or "default" in option.doc
    text = option.doc if no_default else f"{option.doc} (default: {option.default})"
    body = _wrap(text, width - _FLAG_WIDTH)
    pad = " " * _FLAG_WIDTH
    head = f"  {option.flags}"
    if len(head) < _FLAG_WIDTH - 1:
        return [head.ljust(_FLAG_WIDTH) + body[0], *(pad + line for line in body[1:])]
    if len(head) > width:  # a long list of choices
        head = "\n".join(_wrap(head.replace(",", ", "), width, subsequent_indent="    "))
    return [head, *(pad + line for line in body)]


def _header(width: int, cls: type = TrainCommand, usage: str = "dropless train") -> list[str]:
    description = " ".join(inspect.cleandoc(cls.__doc__).split())
    return [f"usage: {usage} [OPTIONS]", "", *_wrap(description, width), ""]


def command_options(cls: type, defaults: object | None = None) -> list[Option]:
    """The arguments and options of a command dataclass `cls`, from its fields: flags, field
    docstring, default (that of `defaults` if given; "required" where there is none)."""
    docs = attribute_docs(cls)
    out = []
    for field in dataclasses.fields(cls):
        if defaults is not None:
            value = getattr(defaults, field.name)
        elif field.default is not dataclasses.MISSING:
            value = field.default
        else:
            value = REQUIRED
        group = "arguments" if is_positional(field.type) else "options"
        out.append(
            Option(field.name, _flags(field.name, field.type), docs[field.name], value, group)
        )
    return out


REQUIRED = "required"


def command_help(cls: type, prog: str, defaults: object | None = None) -> str:
    """`dropless COMMAND --help` of a command dataclass: its docstring, then each argument and
    option with its field docstring and default."""
    width = _width()
    found = command_options(cls, defaults)
    arguments = " ".join(o.flags for o in found if o.group == "arguments")
    lines = _header(width, cls, f"{prog} {arguments}".rstrip())
    for group in ("arguments", "options"):
        rows = [o for o in found if o.group == group]
        if rows:
            lines += [*([""] if lines[-1] else []), f"{group}:"]
        for option in rows:
            if group == "arguments" or option.default is REQUIRED:
                option = dataclasses.replace(option, doc=f"{option.doc} (required)", default=None)
                lines += _format(option, width, default=False)
            else:
                lines += _format(option, width)
    return "\n".join(lines)


def flag_names(found: list[Option]) -> list[str]:
    """Every flag in `found` (`--resume`, `--no-resume`, ...), without metavars."""
    return [
        part.split()[0]
        for option in found
        if option.group != "arguments"
        for part in option.flags.split(", ")
    ]


def short_help(defaults: TrainCommand) -> str:
    """`dropless train --help`: the common options."""
    width = _width()
    by_name = {option.name: option for option in options(defaults)}
    lines = [*_header(width), "common options:"]
    for name in COMMON:
        lines += _format(by_name[name], width)
    groups = dict.fromkeys(option.group for option in by_name.values())
    more = (
        f"dropless train --help-all lists all {len(by_name)} options, by group: "
        f"{'; '.join(groups)}. Any of them can also be given as --set model.<field>=<value> "
        "or train.<field>=<value>."
    )
    return "\n".join([*lines, "", *_wrap(more, width)])


def full_help(defaults: TrainCommand) -> str:
    """`dropless train --help-all`: every option, by group."""
    width = _width()
    lines = _header(width)
    notes = {MODEL_GROUP: attribute_docs(TrainCommand)["model"]}
    group = None
    for option in options(defaults):
        if option.group != group:
            group = option.group
            lines += [*([""] if lines[-1] else []), f"{group}:"]
            lines += _wrap(notes.get(group, ""), width, initial_indent="  ", subsequent_indent="  ")
        lines += _format(option, width)
    return "\n".join(lines)
