"""Type checks of config dataclass fields: a YAML value or a `--set` override can be a float
where an int is meant (`steps=2.0`), which would otherwise fail far from its cause."""

import dataclasses
import numbers
import types
import typing

_RULES = {
    int: (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an int"),
    float: (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    bool: (lambda v: isinstance(v, bool), "True or False"),
}


def field_type_error(config) -> str | None:
    """'name (value) must be ...' for the first int, float or bool field of the dataclass
    `config` (optionally `| None`) whose value is not of that kind; None if all are."""
    for field in dataclasses.fields(config):
        kind, optional = field.type, False
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None
            args = typing.get_args(kind)
            optional = type(None) in args
            kind = next((a for a in args if a is not type(None)), None)
        if kind not in _RULES:
            continue
        value = getattr(config, field.name)
        accepts, wanted = _RULES[kind]
        if not (accepts(value) or (optional and value is None)):
            return f"{field.name} ({value!r}) must be {wanted}{' or None' if optional else ''}"
    return None
