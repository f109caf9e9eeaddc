"""Type checks of config dataclass fields: a YAML value or a `--set` override can be a float
where an int is meant (`steps=2.0`), which would otherwise fail far from its cause."""

import dataclasses
import numbers
import types
import typing

import numpy as np


def is_number(value) -> bool:
    """A real number (Python or NumPy scalar), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


_RULES = {
    int: (
        lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool | np.bool_),
        "an int",
    ),
    float: (is_number, "a number"),
    bool: (lambda v: isinstance(v, bool | np.bool_), "True or False"),
}


def _kind(annotation) -> tuple[type | None, bool]:
    """(int, float or bool, whether None is allowed) for `T` or `T | None`; (None, _) for any
    other annotation, which is not checked."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        others = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(others) != 1:
            return None, False
        return (others[0] if others[0] in _RULES else None), True
    return (annotation if annotation in _RULES else None), False


def field_type_error(config) -> str | None:
    """'name (value) must be ...' for the first field of the dataclass `config` annotated int,
    float or bool (optionally `| None`) whose value is not of that kind (Python or NumPy
    scalars; arrays are refused); None if all are."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        kind, optional = _kind(hints[field.name])
        if kind is None:
            continue
        value = getattr(config, field.name)
        accepts, wanted = _RULES[kind]
        if not (accepts(value) or (optional and value is None)):
            return f"{field.name} ({value!r}) must be {wanted}{' or None' if optional else ''}"
    return None
