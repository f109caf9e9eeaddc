"""field_type_error: the kind of each int, float and bool field of a config dataclass."""

import dataclasses

import numpy as np
import pytest

from dropless.field_types import field_type_error


@dataclasses.dataclass
class Example:
    count: int = 1
    rate: float = 0.5
    flag: bool = False
    rank: int | None = None
    name: str = "x"


@pytest.mark.parametrize(
    "changes", [{}, {"count": np.int64(3)}, {"rate": 2}, {"rank": 4}, {"name": 5}]
)
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
    ],
)
def test_the_first_wrong_field_is_named_with_its_rule(changes, message):
    assert field_type_error(Example(**changes)) == message
