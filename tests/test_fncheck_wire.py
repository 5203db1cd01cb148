"""The function checker's value format: exact round trips, and a decoder that builds only fresh
builtins within limits (it is where the candidate's bytes become objects in the judge)."""

from __future__ import annotations

import json
import math

import pytest

from coderl.grading.fncheck import wire

VALUES = [
    None,
    True,
    0,
    -(10**40),
    1.5,
    float("inf"),
    "a\ud800é",
    b"\x00\xff",
    3 + 4j,
    [1, [2, (3, "x")]],
    (1,),
    {1, 2},
    frozenset({"a"}),
    {"k": [1], 2: (3,), (1, 2): None},
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_round_trip_keeps_value_and_exact_types(value):
    back = wire.loads(wire.dumps(value))
    assert back == value and type(back) is type(value)
    wire.dumps(value).encode("ascii")  # one ASCII line, lone surrogates escaped


def test_nan_round_trips_as_nan():
    assert math.isnan(wire.loads(wire.dumps(float("nan"))))


@pytest.mark.parametrize(
    "value",
    [
        type("Yes", (int,), {"__eq__": lambda s, o: True})(1),
        type("S", (str,), {})("x"),
        object(),
        (x for x in []),
        [float],
    ],
    ids=["int_subclass", "str_subclass", "object", "generator", "type"],
)
def test_only_exact_builtin_types_encode(value):
    with pytest.raises(wire.WireError):
        wire.dumps(value)


def test_decoder_limits_and_malformed_documents():
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(wire.WireError):
        wire.loads(deep)
    nested = []
    for _ in range(wire.MAX_DEPTH + 5):
        nested = [nested]
    with pytest.raises(wire.WireError):
        wire.dumps(nested)
    for doc in (
        {"eval": "1"},
        {"tuple": [1], "set": [2]},
        {"set": [[1]]},  # unhashable member
        {"dict": [[[1], 2]]},  # unhashable key
        {"dict": [[1]]},
        {"bytes": "zz"},
        {"complex": ["1", 2]},
    ):
        with pytest.raises(wire.WireError):
            wire.loads(json.dumps(doc))
    with pytest.raises(wire.WireError):
        wire.loads("not json")
