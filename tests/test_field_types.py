"""field_type_error: the kind of each int, float and bool field of a config dataclass."""

import dataclasses

import numpy as np
import pytest

from dropless._field_types import field_type_error


@dataclasses.dataclass
class Example:
    count: int = 1
    rate: float = 0.5
    flag: bool = False
    rank: int | None = None
    name: str = "x"
    either: int | float = 2.5  # a union other than `T | None`: not checked
    size: "int" = 3  # a string annotation, as under `from __future__ import annotations`


@pytest.mark.parametrize(
    "changes",
    [{}, {"count": np.int64(3)}, {"rate": 2}, {"rate": np.float32(0.5)}, {"rank": 4},
     {"flag": np.bool_(True)}, {"name": 5}, {"either": "x"}],
)  # fmt: skip
def test_values_of_the_right_kind_pass(changes):
    assert field_type_error(Example(**changes)) is None


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"count": 2.0}, "count (2.0) must be an int"),
        ({"count": True}, "count (True) must be an int"),
        ({"rate": "fast"}, "rate ('fast') must be a number"),
        ({"flag": 1}, "flag (1) must be True or False"),
        ({"rank": 8.0}, "rank (8.0) must be an int or None"),
        ({"size": 3.0}, "size (3.0) must be an int"),
        ({"count": np.bool_(True)}, "count (np.True_) must be an int"),
        ({"rate": np.array(0.5)}, "rate (array(0.5)) must be a number"),
    ],
)
def test_the_first_wrong_field_is_named_with_its_rule(changes, message):
    assert field_type_error(Example(**changes)) == message
